"""DNS discovery: resolve a name (a Kubernetes headless Service) periodically; every address is
a replica. New addresses join the pool (not ready until their first good probe); vanished ones
take no new work and leave once their in-flight requests finish. A failed lookup changes
nothing (a DNS hiccup must not empty the pool); a lookup that succeeds with no address does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from common.config import DnsDiscovery
from router.pool import Pool, ReplicaState

log = logging.getLogger("gpupool.router.discovery")

# (name, port) -> addresses (IPv4 or IPv6 literals).
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(name: str, port: int) -> list[str]:
    """The event loop's getaddrinfo (the system resolver, as Kubernetes DNS expects)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def replica_url(address: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(address).version == 6
    except ValueError:
        is_v6 = False
    return f"http://[{address}]:{port}" if is_v6 else f"http://{address}:{port}"


def replica_name(address: str, port: int) -> str:
    return f"{address}:{port}"


class DnsDiscoverer:
    def __init__(
        self,
        pool: Pool,
        config: DnsDiscovery,
        resolver: Resolver,
        *,
        max_concurrency: int = 1,
        max_queue: int = 32,
    ) -> None:
        self.pool = pool
        self.config = config
        self.resolver = resolver
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        # Names this discoverer added (it never removes replicas it did not add).
        self.owned: set[str] = set()
        self.last_error: str | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # discovery must not end for good over one odd answer
                log.exception("DNS discovery failed (pool unchanged); trying again")
            await asyncio.sleep(self.config.interval_s)

    async def refresh(self) -> None:
        try:
            addresses = await self.resolver(self.config.name, self.config.port)
        # socket.gaierror is an OSError; a name IDNA cannot encode (a label over 63
        # characters) is a UnicodeError.
        except (OSError, TimeoutError, UnicodeError) as exc:
            self.last_error = f"resolving {self.config.name}: {exc}"
            log.warning("DNS discovery: %s (pool unchanged)", self.last_error)
            return
        self.last_error = None
        port = self.config.port
        wanted = {replica_name(a, port): replica_url(a, port) for a in addresses}
        for name, url in wanted.items():
            current = self.pool.get(name)
            if current is None or current.removing:
                self.pool.add(
                    ReplicaState(
                        name=name,
                        url=url,
                        max_concurrency=self.max_concurrency,
                        max_queue=self.max_queue,
                    )
                )
                self.owned.add(name)
                log.info("DNS discovery: replica %s joined", name)
        for name in sorted(self.owned - wanted.keys()):
            self.owned.discard(name)
            if self.pool.remove(name) is not None:
                log.info("DNS discovery: replica %s left (finishing its in-flight)", name)
        # Replicas removed earlier whose in-flight has since finished.
        for replica in self.pool.list():
            self.pool.reap(replica)
