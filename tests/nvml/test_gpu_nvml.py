"""agents/gpu.py's NVML paths, run against a fake NVML library loaded by the real pynvml.

`tests/nvml/fake_nvml.c` is compiled into `libnvidia-ml.so.1`; a child process with it on
LD_LIBRARY_PATH runs `agents.gpu.NvmlGpus` unchanged, so presence, detach (NVML_ERROR_GPU_IS_LOST),
memory, MIG and per-process reads go through pynvml's ctypes calls exactly as on a GPU host.
"""

from __future__ import annotations

import pytest

GiB = 1024**3
pytestmark = pytest.mark.timeout(60)

A100 = "gpu 0 present {total} {used} NVIDIA A100-SXM4-80GB"


def gpu0(used: int = 30 * GiB) -> str:
    return A100.format(total=80 * GiB, used=used)


def test_no_driver_means_present_none_and_says_why(nvml_reader):
    reader, _ = nvml_reader(None)  # no state file: nvmlInit answers NVML_ERROR_DRIVER_NOT_LOADED
    assert "Driver Not Loaded" in reader.unavailable
    assert reader.read(0) == {
        "index": 0,
        "present": None,
        "name": "",
        "memory_total_bytes": 0,
        "memory_used_bytes": 0,
        "memory_free_bytes": 0,
        "processes": [],
        "mig": False,
        "accounted": False,
    }


def test_a_present_gpu_with_its_memory_and_processes(nvml_reader):
    reader, _ = nvml_reader([gpu0(), "proc 0 -1 4242 21474836480", "proc 0 -1 4250 1073741824"])
    assert reader.unavailable == ""
    r = reader.read(0)
    assert (r["present"], r["name"], r["mig"], r["accounted"]) == (True, "NVIDIA A100-SXM4-80GB", False, True)
    assert (r["memory_total_bytes"], r["memory_used_bytes"], r["memory_free_bytes"]) == (80 * GiB, 30 * GiB, 50 * GiB)
    assert r["processes"] == [{"pid": 4242, "used_bytes": 20 * GiB}, {"pid": 4250, "used_bytes": GiB}]


def test_detach_is_gpu_is_lost_and_an_unknown_index_is_absent(nvml_reader):
    reader, change = nvml_reader([gpu0(), "gpu 1 present 25769803776 0 L4"])
    assert reader.read(0)["present"] is True and reader.read(1)["name"] == "L4"
    change([A100.format(total=80 * GiB, used=0).replace("present", "lost"), "gpu 1 present 25769803776 0 L4"])
    lost = reader.read(0)
    assert lost["present"] is False and lost["memory_total_bytes"] == 0 and lost["processes"] == []
    assert reader.read(1)["present"] is True  # the other GPU still answers
    assert reader.read(5)["present"] is False  # no such index: NVML_ERROR_INVALID_ARGUMENT
    change([gpu0(used=GiB), "gpu 1 present 25769803776 0 L4"])  # the provider gave it back
    assert reader.read(0)["present"] is True and reader.read(0)["memory_used_bytes"] == GiB
    assert reader.close() == "closed"


def test_mig_memory_and_processes_are_summed_over_the_instances(nvml_reader):
    reader, _ = nvml_reader(
        [
            gpu0(used=0),
            "mig 0 0 21474836480 10737418240",
            "mig 0 2 42949672960 5368709120",
            "proc 0 0 100 10737418240",
            "proc 0 2 200 5368709120",
            "proc 0 -1 300 1",
        ]
    )
    r = reader.read(0)
    assert r["mig"] is True and r["present"] is True
    assert r["memory_total_bytes"] == 80 * GiB  # the parent's total
    assert (r["memory_used_bytes"], r["memory_free_bytes"]) == (15 * GiB, 45 * GiB)  # summed over instances
    assert sorted((p["pid"], p["used_bytes"]) for p in r["processes"]) == [(100, 10 * GiB), (200, 5 * GiB)]


@pytest.mark.parametrize(
    "extra, processes, accounted",
    [
        (["no_v3"], [{"pid": 7, "used_bytes": 2 * GiB}], True),  # an older driver: _v2
        (["no_v3", "no_v2"], [], False),  # neither: nothing attributable, said so
        (["procs_rc 3"], [], False),  # NOT_SUPPORTED
    ],
)
def test_per_process_versions_and_their_absence(nvml_reader, extra, processes, accounted):
    reader, _ = nvml_reader([gpu0(), "proc 0 -1 7 2147483648", *extra])
    r = reader.read(0)
    assert r["present"] is True and r["processes"] == processes and r["accounted"] is accounted


def test_memory_nvml_cannot_attribute_is_not_accounted(nvml_reader):
    reader, _ = nvml_reader([gpu0(), "proc 0 -1 7 unknown", "proc 0 -1 8 1024"])
    r = reader.read(0)
    assert r["processes"] == [{"pid": 7, "used_bytes": 0}, {"pid": 8, "used_bytes": 1024}]
    assert r["accounted"] is False  # usedGpuMemory None (WDDM, some MIG setups): no figures to compare


def test_an_init_failure_is_an_honest_none(nvml_reader):
    reader, _ = nvml_reader(["init_rc 9", gpu0()])
    assert reader.unavailable and reader.read(0)["present"] is None


def test_critical_xid_and_ecc_faults_are_read_through_nvml(nvml_reader):
    # agents/signals.py on the real pynvml: nothing while NVML does not support ECC queries (no guess),
    # then ECC double-bit errors, pages pending retirement, and a critical XID event delivered once.
    reader, rewrite = nvml_reader(["gpu 0 present 25769803776 0 Fake GPU"])
    assert reader.signals(0) == []
    rewrite(["gpu 0 present 25769803776 0 Fake GPU", "ecc 0 0", "pending 0 0"])
    assert reader.signals(0) == []
    rewrite(["gpu 0 present 25769803776 0 Fake GPU", "ecc 0 2", "pending 0 1", "xid 0 79"])
    got = reader.signals(0)
    assert [s for s, _ in got] == ["gpu_xid", "gpu_ecc", "gpu_ecc"]
    assert "XID 79" in got[0][1] and "2 uncorrected" in got[1][1] and "pending" in got[2][1]
    assert [s for s, _ in reader.signals(0)] == ["gpu_ecc", "gpu_ecc"]  # the XID event was consumed
    rewrite(["gpu 0 lost 25769803776 0 Fake GPU"])
    assert reader.signals(0) == []  # a lost GPU is the presence watcher's news
