"""The GPU seam's pure parts, and NVML on this GPU-less box: an honest None, never a crash."""

from __future__ import annotations

import msgspec
import pytest

from haru.agents.gpu import GpuReading, NvmlGpus, open_gpus, presence_from_nvml_error
from haru.agents.sim.errors import BadSize
from haru.agents.sim.gpu_state import GiB, MiB, parse_size
from haru.core.errors import ConfigError
from haru.core.events import GpuProcess


def _nvml_loads() -> bool:
    gpus = NvmlGpus()
    try:
        return gpus.available
    finally:
        gpus.close()


@pytest.mark.skipif(_nvml_loads(), reason="this host has NVML; the no-NVML path is what is tested here")
def test_nvml_without_a_driver_says_none_for_every_gpu():
    gpus = open_gpus("nvml")
    try:
        assert isinstance(gpus, NvmlGpus)
        assert gpus.unavailable  # says why (e.g. "NVML Shared Library Not Found")
        for index in (0, 1, 7):
            reading = gpus.read(index)
            assert reading == GpuReading(index=index, present=None)
            assert reading.memory_total_bytes == 0 and reading.processes == []
    finally:
        gpus.close()
    gpus.close()  # closing twice is harmless


def test_nvml_errors_that_mean_the_gpu_is_gone():
    import pynvml

    assert presence_from_nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST) is False
    assert presence_from_nvml_error(pynvml.NVML_ERROR_NOT_FOUND) is False
    assert presence_from_nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT) is False  # no such index
    assert presence_from_nvml_error(pynvml.NVML_ERROR_UNKNOWN) is None
    assert presence_from_nvml_error(pynvml.NVML_ERROR_TIMEOUT) is None


def test_reading_is_a_frozen_struct_that_round_trips():
    reading = GpuReading(
        index=1,
        present=True,
        name="H100",
        memory_total_bytes=80 * GiB,
        memory_used_bytes=GiB,
        memory_free_bytes=79 * GiB,
        processes=[GpuProcess(pid=42, used_bytes=GiB)],
        mig=True,
    )
    with pytest.raises(AttributeError):
        reading.present = False  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(reading), type=GpuReading) == reading


def test_open_gpus_refuses_what_it_cannot_build():
    with pytest.raises(ConfigError, match="sim_dir"):
        open_gpus("sim")
    with pytest.raises(ConfigError, match="cuda"):
        open_gpus("cuda")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("1073741824", GiB),
        ("2GB", 2 * 10**9),
        ("8 gib", 8 * GiB),
        (123, 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1GiB", "4GiB extra"])
def test_parse_size_refuses_with_the_fix(text):
    with pytest.raises(BadSize, match="e.g. 4GiB"):
        parse_size(text)
