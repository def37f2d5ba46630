"""The simulated GPU file, SimGpus, the simulated trainer and `haru sim`: real files, real processes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from haru.agents.gpu import GpuReading, Gpus, NvmlGpus, SimGpus, open_gpus
from haru.agents.sim.gpu_state import GiB, SimGpuState
from haru.cli import sim as sim_cli
from haru.cli.common import ExitStatus
from haru.core.events import GpuProcess
from haru.host.procfs import pid_alive
from tests.support.wait import wait_until_sync


@pytest.fixture
def children():
    """Child processes started by a test, killed and reaped however the test ends."""
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kw)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _sleeper(children) -> subprocess.Popen:
    return children([sys.executable, "-c", "import time; time.sleep(60)"])


# ----------------------------------------------------------------------------------- GPU state file


def test_allocations_are_accounted_and_refused_beyond_total(tmp_path, children):
    gpu = SimGpuState(tmp_path, 0)
    gpu.ensure(10 * GiB, "Sim A100")
    a, b = _sleeper(children), _sleeper(children)
    assert gpu.allocate(a.pid, 6 * GiB)
    assert not gpu.allocate(b.pid, 5 * GiB)  # would exceed the total: out of memory
    assert gpu.allocate(b.pid, 4 * GiB)
    state = gpu.read()
    assert state["memory_used_bytes"] == 10 * GiB and state["memory_free_bytes"] == 0
    assert state["allocations"] == {str(a.pid): 6 * GiB, str(b.pid): 4 * GiB}
    assert gpu.allocate(a.pid, 2 * GiB)  # an allocation replaces what the pid held
    assert not gpu.allocate(a.pid, 7 * GiB)  # ... and a refused one leaves it as it was
    assert gpu.read()["allocations"][str(a.pid)] == 2 * GiB
    gpu.free(a.pid)
    assert gpu.read()["memory_used_bytes"] == 4 * GiB
    gpu.ensure(99 * GiB, "other")  # ensure never resets an existing GPU
    assert gpu.read()["memory_total_bytes"] == 10 * GiB and gpu.read()["name"] == "Sim A100"


def test_a_sigkilled_allocator_frees_its_memory(tmp_path, children):
    gpu = SimGpuState(tmp_path, 0)
    gpu.ensure(10 * GiB)
    victim = _sleeper(children)
    assert gpu.allocate(victim.pid, 8 * GiB)
    assert not gpu.allocate(os.getpid(), 4 * GiB)
    victim.send_signal(signal.SIGKILL)
    # a zombie (not yet reaped) already holds nothing
    wait_until_sync(lambda: not pid_alive(victim.pid), 10.0, interval_s=0.01)
    assert gpu.read()["memory_used_bytes"] == 0
    assert gpu.allocate(os.getpid(), 4 * GiB)
    victim.wait()
    raw = json.loads(gpu.path.read_text())
    assert str(victim.pid) not in raw["allocations"]  # the dead pid was dropped from the file on write


def test_concurrent_writers_lose_no_update(tmp_path, children):
    SimGpuState(tmp_path, 0).ensure(64 * GiB)
    code = (
        "import sys, time; from agents.sim.gpu_state import SimGpuState, GiB\n"
        "g = SimGpuState(sys.argv[1], 0)\n"
        "for i in range(20): g.allocate(__import__('os').getpid(), (i % 3 + 1) * GiB)\n"
        "print('ok', flush=True); time.sleep(60)\n"
    )
    procs = [children([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE) for _ in range(6)]
    for proc in procs:
        assert proc.stdout.readline().strip() == b"ok"
    state = SimGpuState(tmp_path, 0).read()
    assert state["allocations"] == {str(p.pid): 2 * GiB for p in procs}  # 19 % 3 + 1 = 2, every one kept


def test_detach_keeps_memory_but_sim_gpus_reports_absent(tmp_path, children):
    holder = _sleeper(children)
    gpu = SimGpuState(tmp_path, 1)
    gpu.ensure(24 * GiB, "Sim L4")
    gpu.allocate(holder.pid, 3 * GiB)
    gpus = SimGpus(tmp_path)
    assert gpus.read(1) == GpuReading(
        index=1,
        present=True,
        name="Sim L4",
        memory_total_bytes=24 * GiB,
        memory_used_bytes=3 * GiB,
        memory_free_bytes=21 * GiB,
        processes=[GpuProcess(pid=holder.pid, used_bytes=3 * GiB)],
        accounted=True,
    )
    gpu.set_present(False)
    reading = gpus.read(1)
    assert reading.present is False and reading.processes == []
    assert not gpu.allocate(os.getpid(), GiB)  # nothing allocates on a GPU that is gone
    gpu.set_present(True)
    assert gpus.read(1).memory_used_bytes == 3 * GiB
    assert gpus.read(0).present is False  # no such GPU in this host


# --------------------------------------------------------------------- one contract, each implementation


@pytest.fixture(params=["sim", "nvml"])
def any_gpus(request, tmp_path):
    if request.param == "sim":
        SimGpuState(tmp_path, 0).ensure(8 * GiB)
    gpus: Gpus = open_gpus(request.param, sim_dir=tmp_path)
    try:
        yield request.param, gpus
    finally:
        gpus.close()


def test_gpus_contract_reads_never_raise(any_gpus):
    kind, gpus = any_gpus
    for index in (0, 5, 1000):
        reading = gpus.read(index)
        assert isinstance(reading, GpuReading) and reading.index == index
        assert reading.present in (True, False, None)
        if reading.present:
            assert reading.memory_used_bytes + reading.memory_free_bytes <= reading.memory_total_bytes
            assert reading.memory_total_bytes > 0
        else:
            assert reading.processes == []
    if isinstance(gpus, NvmlGpus) and not gpus.available:
        assert gpus.read(0).present is None  # no NVML: cannot know, and says so
    if kind == "sim":
        assert gpus.read(0).present is True and gpus.read(5).present is False


# ------------------------------------------------------------------------------------------ trainer


def _trainer(children, tmp_path: Path, *extra: str, gpu_index: int = 0, env_extra: dict | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARU_")}
    env.update({"HARU_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "HARU_GPU_INDEX": str(gpu_index)})
    env.update(env_extra or {})
    err = open(tmp_path / "trainer.err", "ab")
    return children(
        [
            sys.executable,
            "-m",
            "haru.agents.sim.trainer",
            "--vram",
            "8GiB",
            "--sim-dir",
            str(tmp_path / "sim"),
            "--step-ms",
            "10",
            "--checkpoint-every-ms",
            "50",
            *extra,
        ],
        env=env,
        stderr=err,
    )


def _held_by(tmp_path: Path, pid: int, index: int = 0) -> int:
    if not SimGpuState(tmp_path / "sim", index).exists():
        return 0  # the trainer has not created its GPU yet
    return SimGpuState(tmp_path / "sim", index).read()["allocations"].get(str(pid), 0)


def test_trainer_sees_the_two_variables_and_exits_on_sigterm_freeing_memory(tmp_path, children):
    SimGpuState(tmp_path / "sim", 2).ensure(24 * GiB)
    proc = _trainer(children, tmp_path, gpu_index=2)
    wait_until_sync(lambda: _held_by(tmp_path, proc.pid, 2) == 8 * GiB, 10.0, interval_s=0.01)
    env = json.loads((tmp_path / "ckpt" / "env.json").read_text())
    assert env["HARU_CHECKPOINT_DIR"] == str(tmp_path / "ckpt") and env["HARU_GPU_INDEX"] == "2"
    wait_until_sync(lambda: (tmp_path / "ckpt" / "checkpoint.json").exists(), 10.0, interval_s=0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert SimGpuState(tmp_path / "sim", 2).read()["allocations"] == {}
    step = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["step"]
    assert step > 0
    # A restarted trainer resumes from its checkpoint.
    again = _trainer(children, tmp_path, "--exit-after-ms", "100", gpu_index=2)
    assert again.wait(10) == 0
    assert json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["step"] > step


def test_trainer_that_ignores_sigterm_must_be_killed_and_its_memory_is_dropped(tmp_path, children):
    proc = _trainer(children, tmp_path, "--ignore-sigterm")
    wait_until_sync(lambda: _held_by(tmp_path, proc.pid) == 8 * GiB, 10.0, interval_s=0.01)
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.4)
    assert _held_by(tmp_path, proc.pid) == 8 * GiB
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    assert SimGpuState(tmp_path / "sim", 0).read()["memory_used_bytes"] == 0


def test_trainer_without_room_exits_with_cuda_oom(tmp_path, children):
    holder = _sleeper(children)
    gpu = SimGpuState(tmp_path / "sim", 0)
    gpu.ensure(10 * GiB)
    gpu.allocate(holder.pid, 4 * GiB)
    proc = _trainer(children, tmp_path)
    assert proc.wait(10) == 1
    assert "CUDA out of memory" in (tmp_path / "trainer.err").read_text()


def test_trainer_dies_with_its_gpu(tmp_path, children):
    proc = _trainer(children, tmp_path)
    wait_until_sync(lambda: _held_by(tmp_path, proc.pid) == 8 * GiB, 10.0, interval_s=0.01)
    SimGpuState(tmp_path / "sim", 0).set_present(False)
    assert proc.wait(10) == 1
    assert "CUDA error" in (tmp_path / "trainer.err").read_text()


# ---------------------------------------------------------------------------------------- haru sim


def haru_sim(*argv: str) -> ExitStatus:
    parser = argparse.ArgumentParser(prog="haru")
    sim_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sim", *argv])
    return args.handler(args)


def _serve(children, root: Path, domain: str, model: str) -> tuple[subprocess.Popen, dict]:
    env = {
        **os.environ,
        "HARU_SIM_DIR": str(root / domain),
        "HARU_SIM_DOMAIN": domain,
        "HARU_SIM_LOAD_MS": "50",
        "VLLM_SERVER_DEV_MODE": "1",
        "HARU_SIM_VRAM": "2GiB",
    }
    proc = children(
        [
            sys.executable,
            "-m",
            "haru.agents.sim.vllm",
            "serve",
            model,
            "--port",
            "0",
            "--served-model-name",
            model,
            "--enable-sleep-mode",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    from haru.agents.sim.vllm import runtime_path

    rt_file = runtime_path(root / domain, model)
    info = wait_until_sync(
        lambda: (
            rt_file.exists()
            and json.loads(rt_file.read_text() or "{}").get("pid") == proc.pid
            and json.loads(rt_file.read_text())
        ),
        10.0,
        interval_s=0.01,
    )
    return proc, info


def _get(port: int, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _ready(port: int) -> bool:
    try:
        return _get(port, "/health")[0] == 200
    except OSError:
        return False


def test_haru_sim_cli_injects_faults_by_hand(tmp_path, children, capsys):
    root = tmp_path / "simroot"
    assert haru_sim("add-gpu", "a", "--memory", "16GiB", "--sim-root", str(root)) == ExitStatus.OK
    proc, info = _serve(children, root, "a", "llama:8b")
    wait_until_sync(lambda: _ready(info["port"]), 10.0, interval_s=0.01)
    chat = json.dumps({"model": "llama:8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()

    assert haru_sim("detach-gpu", "a", "--sim-root", str(root)) == ExitStatus.OK
    assert _get(info["port"], "/v1/chat/completions", "POST", chat)[0] == 500
    assert haru_sim("attach-gpu", "a", "--gpu", "0", "--sim-root", str(root)) == ExitStatus.OK
    assert _get(info["port"], "/v1/chat/completions", "POST", chat)[0] == 200

    assert haru_sim("fail-probe", "a", "llama:8b", "--sim-root", str(root)) == ExitStatus.OK
    assert _get(info["port"], "/v1/chat/completions", "POST", chat)[0] == 500
    assert haru_sim("reset", "a", "llama:8b", "--sim-root", str(root)) == ExitStatus.OK
    assert _get(info["port"], "/v1/chat/completions", "POST", chat)[0] == 200

    assert haru_sim("oom-on-wake", "a", "llama:8b", "--sim-root", str(root)) == ExitStatus.OK
    assert _get(info["port"], "/sleep?level=1", "POST")[0] == 200
    status, body = _get(info["port"], "/wake_up", "POST")
    assert status == 500 and b"CUDA Error: out of memory" in body

    capsys.readouterr()
    assert haru_sim("status", "a", "--json", "--sim-root", str(root)) == ExitStatus.OK
    [host] = json.loads(capsys.readouterr().out)
    assert host["gpus"][0]["present"] is True
    [rt] = host["runtimes"]
    assert rt["model"] == "llama:8b" and rt["alive"] and rt["state"]["sleeping"] is True

    assert haru_sim("evict", "a", "llama:8b", "--sim-root", str(root)) == ExitStatus.OK
    assert json.loads(_get(info["port"], "/v1/models")[1])["data"] == []

    assert haru_sim("kill-runtime", "a", "llama:8b", "--sim-root", str(root)) == ExitStatus.OK
    assert proc.wait(10) == -signal.SIGKILL
    assert haru_sim("status", "--sim-root", str(root)) == ExitStatus.OK
    out = capsys.readouterr().out
    assert "domain a" in out and "DEAD" in out


def test_haru_sim_cli_names_what_is_missing(tmp_path, capsys):
    root = str(tmp_path / "nothing")
    assert haru_sim("detach-gpu", "a", "--gpu", "3", "--sim-root", root) == ExitStatus.NOT_FOUND
    assert "add-gpu" in capsys.readouterr().err
    assert haru_sim("evict", "a", "no-such-model", "--sim-root", root) == ExitStatus.NOT_FOUND
    assert haru_sim("status", "b", "--sim-root", root) == ExitStatus.NOT_FOUND


def test_sim_root_defaults_to_haru_home(monkeypatch, tmp_path):
    monkeypatch.delenv("HARU_SIM_ROOT", raising=False)
    monkeypatch.setenv("HARU_HOME", str(tmp_path / "home"))
    assert sim_cli.default_sim_root() == tmp_path / "home" / "sim"
    monkeypatch.setenv("HARU_SIM_ROOT", str(tmp_path / "elsewhere"))
    assert sim_cli.default_sim_root() == tmp_path / "elsewhere"
