"""GPU memory readings through NVML, behind a small protocol so tests run without a GPU.

``NvmlProbe`` is the only place that imports pynvml (package ``nvidia-ml-py``). Where NVML is
absent (no driver: CPU machines, CI) every reading is ``None``, cleanly, never an exception.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common.protocol import MemoryInfo


class GpuProbe(Protocol):
    def read(self) -> MemoryInfo | None:
        """Memory of this probe's GPU now, or None where there is no GPU to read."""
        ...


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index: CUDA's too under CUDA_DEVICE_ORDER=PCI_BUS_ID (see pin_to_gpu)
    name: str
    uuid: str
    memory: MemoryInfo


class NoGpuProbe:
    """The probe of a CPU replica."""

    def read(self) -> MemoryInfo | None:
        return None


class FakeGpuProbe:
    """A GPU that is not there: tests and the simulated engine set ``used_bytes`` by hand."""

    def __init__(self, total_bytes: int, used_bytes: int = 0) -> None:
        self.total_bytes = total_bytes
        self.used_bytes = used_bytes

    def read(self) -> MemoryInfo | None:
        used = min(max(self.used_bytes, 0), self.total_bytes)
        return MemoryInfo(
            used_bytes=used, total_bytes=self.total_bytes, free_bytes=self.total_bytes - used
        )


_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {"initialised": False, "module": None, "error": None}


def _nvml() -> Any | None:
    """Initialise NVML once per process; None when the library or driver is missing."""
    with _nvml_lock:
        if _nvml_state["initialised"]:
            return _nvml_state["module"]
        _nvml_state["initialised"] = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
            _nvml_state["error"] = f"{type(exc).__name__}: {exc}"
            return None
        _nvml_state["module"] = pynvml
        return pynvml


def nvml_error() -> str | None:
    """Why NVML is unavailable (after a failed first use), for clear messages."""
    _nvml()
    error = _nvml_state["error"]
    return str(error) if error is not None else None


def _memory(nvml: Any, handle: Any) -> MemoryInfo:
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    return MemoryInfo(
        used_bytes=int(mem.used), total_bytes=int(mem.total), free_bytes=int(mem.free)
    )


def list_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees (ignores CUDA_VISIBLE_DEVICES); [] where there is none."""
    nvml = _nvml()
    if nvml is None:
        return []
    gpus = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        gpus.append(
            GpuInfo(
                index=index,
                name=name.decode() if isinstance(name, bytes) else str(name),
                uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                memory=_memory(nvml, handle),
            )
        )
    return gpus


def pin_to_gpu(nvml_index: str) -> dict[str, str]:
    """The environment that pins a child process to one GPU, named by its NVML index.

    NVML numbers GPUs in PCI bus order; CUDA by default puts the fastest first, so on a host
    with mixed GPUs the two numberings differ. PCI_BUS_ID makes CUDA use NVML's order, so the
    GPU whose memory was checked is the one the replica runs on and reads.
    """
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": nvml_index}


def visible_nvml_index(env: Mapping[str, str], cuda_ordinal: int = 0) -> int | str:
    """Which NVML device is CUDA ordinal ``cuda_ordinal`` under this environment.

    NVML numbers every GPU on the host; CUDA numbers only the visible ones. With
    ``CUDA_VISIBLE_DEVICES=3`` the process's ``cuda:0`` is NVML index 3. Entries may be UUIDs
    (returned as a string to look up by UUID).
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return cuda_ordinal
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if cuda_ordinal >= len(entries):
        raise ValueError(
            f"cuda:{cuda_ordinal} is not visible with CUDA_VISIBLE_DEVICES={visible!r}"
        )
    entry = entries[cuda_ordinal]
    return int(entry) if entry.isdigit() else entry


class NvmlProbe:
    """Memory of one GPU: the process's visible ``cuda:N`` (honours CUDA_VISIBLE_DEVICES)."""

    def __init__(self, env: Mapping[str, str], cuda_ordinal: int = 0) -> None:
        self._target = visible_nvml_index(env, cuda_ordinal)
        self._handle: Any | None = None

    def read(self) -> MemoryInfo | None:
        nvml = _nvml()
        if nvml is None:
            return None
        try:
            if self._handle is None:
                if isinstance(self._target, int):
                    self._handle = nvml.nvmlDeviceGetHandleByIndex(self._target)
                else:
                    self._handle = nvml.nvmlDeviceGetHandleByUUID(self._target)
            return _memory(nvml, self._handle)
        except nvml.NVMLError:
            return None
