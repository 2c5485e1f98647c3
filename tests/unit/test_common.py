"""common/: GPU probes without a GPU, and the stop-sequence matcher the engines share."""

from __future__ import annotations

import pytest

from common.gpu import FakeGpuProbe, NoGpuProbe, NvmlProbe, list_gpus, visible_nvml_index
from replica.engine import StopMatcher


def test_cuda_visible_devices_maps_cuda0_to_the_nvml_index() -> None:
    assert visible_nvml_index({}, 0) == 0
    assert visible_nvml_index({"CUDA_VISIBLE_DEVICES": "3"}, 0) == 3
    assert visible_nvml_index({"CUDA_VISIBLE_DEVICES": "2,5"}, 1) == 5
    assert visible_nvml_index({"CUDA_VISIBLE_DEVICES": "GPU-abc"}, 0) == "GPU-abc"
    with pytest.raises(ValueError, match="not visible"):
        visible_nvml_index({"CUDA_VISIBLE_DEVICES": "1"}, 1)


def test_without_nvml_probes_read_none_and_list_nothing() -> None:
    assert NoGpuProbe().read() is None
    if list_gpus():
        pytest.skip("NVML sees a GPU here")
    # No NVIDIA driver (CPU machines, CI): readings are None, never an exception.
    assert NvmlProbe({"CUDA_VISIBLE_DEVICES": "0"}).read() is None
    assert list_gpus() == []


def test_with_a_gpu_the_probe_reads_its_memory() -> None:
    gpus = list_gpus()
    if not gpus:
        pytest.skip("NVML sees no GPU here")
    reading = NvmlProbe({"CUDA_VISIBLE_DEVICES": str(gpus[0].index)}).read()
    assert reading is not None and reading.total_bytes == gpus[0].memory.total_bytes > 0
    assert reading.used_bytes + reading.free_bytes <= reading.total_bytes


def test_fake_probe_reports_free_memory_and_clamps() -> None:
    probe = FakeGpuProbe(total_bytes=1000, used_bytes=250)
    reading = probe.read()
    assert reading is not None
    assert (reading.used_bytes, reading.free_bytes) == (250, 750)
    probe.used_bytes = 5000
    reading = probe.read()
    assert reading is not None and reading.free_bytes == 0


def test_stop_matcher_never_emits_the_stop_text_even_split_across_pieces() -> None:
    m = StopMatcher(["END"])
    out = [m.feed(p) for p in ["hel", "lo E", "N", "D and more"]]
    assert "".join(out) == "hello "
    assert m.stopped
    assert m.feed("ignored") == ""


def test_stop_matcher_releases_a_false_alarm() -> None:
    m = StopMatcher(["END"])
    assert m.feed("a E") == "a "
    assert m.feed("x") == "Ex"
    assert m.feed("EN") == ""
    assert m.flush() == "EN"
    assert not m.stopped
