"""Router overhead: added latency through the router vs direct, and proxied requests/s.

``python -m bench.router_overhead [--clients 32] [--requests 6400] [--json PATH]
[--router NAME=MODULE [ARG...]]...``

Starts simulated replicas and one router as processes (nothing of router/replica is imported),
or several routers side by side on the same replicas (``--router``, repeatable: e.g.
``--router 'lean=router' --router 'httpx=router --http-client=httpx'``; each is started as
``python -m MODULE ARG... --replica ...``, and measured in turn, round after round), then:

1. latency: ``--clients`` keep-alive clients send ``POST /generate`` to replicas that take a fixed
   ``--fixed-ms`` (50) per request, first straight to the replicas (client i -> replica i mod n),
   then through the router; added latency = router percentile - direct percentile.
2. throughput: replicas with no cost (``fixed_ms=0``), ``--throughput-clients`` clients through
   the router for ``--duration-s``; reports requests/s and requests per router CPU-second (the
   router process's user+system time, from /proc), which is what one router process can proxy
   when it has a core to itself.

The load generator is a minimal HTTP/1.1 keep-alive client on asyncio streams, so the client's
own cost stays small next to what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.replica_proc import free_port

BODY = b'{"text": "hi", "max_tokens": 1}'


@dataclass
class Phase:
    name: str
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    rps: float
    router_cpu_s: float | None = None

    @property
    def per_router_cpu_s(self) -> float | None:
        if not self.router_cpu_s:
            return None
        return self.requests / self.router_cpu_s


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


@contextlib.contextmanager
def start(module: str, args: Sequence[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryFile(prefix=f"bench-{module}-") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            yield proc
        except Exception:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@dataclass
class Router:
    name: str
    module: str
    args: list[str]
    port: int = 0
    pid: int = 0


def parse_router(spec: str) -> Router:
    """``NAME=MODULE [ARG...]``; a bare ``MODULE [ARG...]`` is named after the module."""
    words = shlex.split(spec)
    if not words:
        raise argparse.ArgumentTypeError("--router needs NAME=MODULE")
    name, _, module = words[0].rpartition("=")
    return Router(name or module, module, words[1:])


@contextlib.contextmanager
def fleet(
    replicas: int, fixed_ms: float, routers: Sequence[Router], router_args: Sequence[str]
) -> Iterator[list[int]]:
    """Replica ports; each router started, its ``port`` and ``pid`` set."""
    model = f"simulated:fixed_ms={fixed_ms:g},decode_ms=0,prefill_ms=0"
    ports = [free_port() for _ in range(replicas)]
    with contextlib.ExitStack() as stack:
        for port in ports:
            stack.enter_context(
                start(
                    "replica",
                    ["--model", model, "--max-concurrency", "256", "--max-queue", "1024"],
                    port,
                )
            )
        replica_flags = [f"--replica=r{i}=http://127.0.0.1:{p}" for i, p in enumerate(ports)]
        for router in routers:
            router.port = free_port()
            flags = [*router.args, *replica_flags, *router_args]
            router.pid = stack.enter_context(start(router.module, flags, router.port)).pid
        yield ports


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(
    port: int, path: str, stop_at: float, count: int | None, out: list[float], errors: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    sent = 0
    try:
        while (count is None or sent < count) and time.perf_counter() < stop_at:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            out.append(time.perf_counter() - started)
            if status != 200:
                errors.append(status)
            sent += 1
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _run(
    ports: list[int], clients: int, *, count: int | None, duration_s: float
) -> tuple[list[float], list[int], float]:
    out: list[float] = []
    errors: list[int] = []
    stop_at = time.perf_counter() + duration_s
    per_client = None if count is None else max(count // clients, 1)
    started = time.perf_counter()
    await asyncio.gather(
        *(
            _client(ports[i % len(ports)], "/generate", stop_at, per_client, out, errors)
            for i in range(clients)
        )
    )
    return out, errors, time.perf_counter() - started


@dataclass
class Samples:
    latencies: list[float]
    errors: int = 0
    seconds: float = 0.0
    router_cpu_s: float | None = None


def collect(
    ports: list[int],
    clients: int,
    *,
    count: int | None = None,
    duration_s: float = 600.0,
    warmup: int = 200,
    router_pid: int | None = None,
    into: Samples | None = None,
) -> Samples:
    """One run (after a short warm-up), added to ``into`` when given."""
    into = into or Samples([])
    asyncio.run(_run(ports, clients, count=warmup, duration_s=60))
    cpu_before = cpu_seconds(router_pid) if router_pid else None
    latencies, errors, seconds = asyncio.run(
        _run(ports, clients, count=count, duration_s=duration_s)
    )
    into.latencies += latencies
    into.errors += len(errors)
    into.seconds += seconds
    if router_pid and cpu_before is not None:
        into.router_cpu_s = (into.router_cpu_s or 0.0) + cpu_seconds(router_pid) - cpu_before
    return into


def summarise(name: str, samples: Samples) -> Phase:
    ms = sorted(x * 1000 for x in samples.latencies)
    seconds = samples.seconds
    router_cpu = samples.router_cpu_s

    def pct(p: float) -> float:
        return ms[min(int(p / 100 * len(ms)), len(ms) - 1)]

    return Phase(
        name=name,
        requests=len(ms),
        errors=samples.errors,
        seconds=round(seconds, 3),
        p50_ms=round(pct(50), 3),
        p90_ms=round(pct(90), 3),
        p99_ms=round(pct(99), 3),
        max_ms=round(ms[-1], 3),
        mean_ms=round(statistics.fmean(ms), 3),
        rps=round(len(ms) / seconds, 1),
        router_cpu_s=round(router_cpu, 3) if router_cpu is not None else None,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=6400, help="per latency phase")
    p.add_argument("--rounds", type=int, default=4, help="direct/router alternations")
    p.add_argument("--fixed-ms", type=float, default=50.0)
    p.add_argument("--throughput-clients", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=10.0, help="throughput phase length")
    p.add_argument(
        "--router",
        action="append",
        type=parse_router,
        default=[],
        metavar="NAME=MODULE [ARG...]",
        help="a router to measure (repeatable, side by side); default: router=router",
    )
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for every router")
    p.add_argument("--json", default="results/router_overhead.json")
    p.add_argument("--skip-throughput", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    routers: list[Router] = args.router or [Router("router", "router", [])]
    names = [r.name for r in routers]
    if len(set(names)) != len(names) or "direct" in names:
        print(f"router names must differ from each other and from 'direct': {names}")
        return 2
    phases: list[Phase] = []
    with fleet(args.replicas, args.fixed_ms, routers, args.router_arg) as ports:
        # Direct and routed runs alternate, so a neighbour's burst on this shared machine does
        # not land on one side only.
        direct = Samples([])
        routed = {r.name: Samples([]) for r in routers}
        share = max(args.requests // args.rounds, args.clients)
        for _ in range(args.rounds):
            collect(ports, args.clients, count=share, into=direct)
            for r in routers:
                collect([r.port], args.clients, count=share, router_pid=r.pid, into=routed[r.name])
        phases.append(summarise("direct", direct))
        phases += [summarise(name, samples) for name, samples in routed.items()]
    if not args.skip_throughput:
        with fleet(args.replicas, 0, routers, args.router_arg) as ports:
            clients = args.throughput_clients
            phases.append(
                summarise("direct-max", collect(ports, clients, duration_s=args.duration_s))
            )
            # Several routers: two alternating halves each, for the same reason as above.
            halves = 2 if len(routers) > 1 else 1
            maxed = {r.name: Samples([]) for r in routers}
            for _ in range(halves):
                for r in routers:
                    collect(
                        [r.port],
                        clients,
                        duration_s=args.duration_s / halves,
                        router_pid=r.pid,
                        into=maxed[r.name],
                    )
            phases += [summarise(f"{name}-max", samples) for name, samples in maxed.items()]
    by = {p.name: p for p in phases}
    added = {
        name: {
            "p50_ms": round(by[name].p50_ms - by["direct"].p50_ms, 3),
            "p99_ms": round(by[name].p99_ms - by["direct"].p99_ms, 3),
        }
        for name in names
    }
    width = max(11, *(len(n) + 4 for n in names))
    print(
        f"{'phase':<{width}} {'reqs':>6} {'err':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'req/s':>8} {'router cpu s':>12} {'req/cpu-s':>9}"
    )
    for p in phases:
        per_cpu = p.per_router_cpu_s
        print(
            f"{p.name:<{width}} {p.requests:>6} {p.errors:>4} {p.p50_ms:>8.2f} {p.p90_ms:>8.2f} "
            f"{p.p99_ms:>8.2f} {p.rps:>8.0f} "
            f"{p.router_cpu_s if p.router_cpu_s is not None else '-':>12} "
            f"{f'{per_cpu:.0f}' if per_cpu else '-':>9}"
        )
    for name, add in added.items():
        print(f"added by {name}: p50 {add['p50_ms']:+.2f} ms, p99 {add['p99_ms']:+.2f} ms")
    result = {
        "command": "python -m bench.router_overhead " + shlex.join(argv or sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "config": {**vars(args), "router": [asdict(r) for r in routers]},
        "phases": [{**asdict(p), "per_router_cpu_s": p.per_router_cpu_s} for p in phases],
        "added": added,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if any(p.errors for p in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
