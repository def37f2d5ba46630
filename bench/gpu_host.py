"""NVML on a real card: agents/gpu.py's real paths against a bare NVIDIA machine (at most ~5 minutes).

    python bench/gpu_host.py [--gpu 0] [--runtime-gib 1] [--trainer-gib 2] [--kills 3] [--json]

For a machine with an NVIDIA driver and only `torch` and `nvidia-ml-py` installed, and no network: the
one other thing agents/gpu.py needs, msgspec, is carried in bench/wheels/ and loaded from there when it is
not installed (a wheel for CPython 3.11 on x86_64 Linux; another interpreter says which one it needs).
Run from a checkout of the repository (it imports agents/gpu.py itself, not a copy).

What it does, with torch child processes standing in for Haru's processes:
  1. reads the GPU through `NvmlGpus.read` (name, memory, compute processes, MIG mode, `accounted`);
  2. starts a "runtime" (holds --runtime-gib) and a "trainer" (holds --trainer-gib), each a process that
     allocates on the card and waits, and reads again: per-process memory, accounted to the two by
     `account` (their process trees, as the agent does) and the foreign remainder;
  3. SIGKILLs the trainer and times how long until NVML shows its memory free (its pid gone from the
     compute processes and the used memory down by what it held), --kills times;
  4. reads MIG mode raw (`nvmlDeviceGetMigMode`) beside what `NvmlGpus` concluded;
  5. times one `NvmlGpus.read` (the agent's GPU watcher and verify_gpu call it).
It prints what it saw (and --json a machine-readable summary). Where there is no NVML (no driver, no
library, no nvidia-ml-py) it exits with status 3 and says which.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / "wheels"
MiB = 1024**2
GiB = 1024**3

CHILD = r"""
import os, sys, time, torch
gib = float(sys.argv[1])
x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("ready", os.getpid(), flush=True)
time.sleep(3600)
"""


def need_msgspec() -> None:
    """Import msgspec, or load the carried wheel that matches this interpreter."""
    try:
        import msgspec  # noqa: F401

        return
    except ImportError:
        pass
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    wheels = [w for w in glob.glob(str(WHEELS / "msgspec-*.whl")) if f"-{tag}-" in w and machine in w]
    if not wheels:
        raise SystemExit(
            f"gpu_host: msgspec is not installed and bench/wheels/ has no wheel for {tag} on {machine} "
            f"(carried: {', '.join(os.path.basename(w) for w in glob.glob(str(WHEELS / '*.whl'))) or 'none'}); "
            f"copy msgspec's wheel for this interpreter into bench/wheels/ or `pip install msgspec`"
        )
    target = Path(tempfile.mkdtemp(prefix="haru-gpu-host-wheel-"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(target)
    sys.path.insert(0, str(target))
    import msgspec  # noqa: F401,F811


def start_child(gib: float, gpu: int) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(gib)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it allocated (torch's import and CUDA init: seconds)
    if not line.startswith("ready"):
        err = proc.stderr.read() if proc.stderr else ""
        proc.kill()
        raise SystemExit(f"gpu_host: a torch child could not allocate {gib} GiB on GPU {gpu}: {err.strip()[-800:]}")
    return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def show(r, label: str) -> None:
    procs = ", ".join(f"pid {p.pid} {gib(p.used_bytes)}" for p in r.processes) or "none"
    print(
        f"{label}: present={r.present} name={r.name!r} "
        f"total={gib(r.memory_total_bytes)} used={gib(r.memory_used_bytes)} "
        f"free={gib(r.memory_free_bytes)} mig={r.mig} accounted={r.accounted}"
    )
    print(f"    compute processes: {procs}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", type=int, default=0, help="NVML index of the card (default 0)")
    p.add_argument("--runtime-gib", type=float, default=1.0)
    p.add_argument("--trainer-gib", type=float, default=2.0)
    p.add_argument("--kills", type=int, default=3, help="trainer kills to time (each starts a fresh trainer)")
    p.add_argument("--release-timeout-s", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="also print a JSON summary")
    args = p.parse_args(argv)
    deadline = time.monotonic() + 300  # the whole run stays under ~5 minutes

    sys.path.insert(0, str(REPO))
    need_msgspec()
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the `pynvml` shim package warns; nvidia-ml-py does not
            import pynvml  # noqa: F401  (nvidia-ml-py)
    except ImportError:
        print(
            "gpu_host: no NVML here: the nvidia-ml-py package (module pynvml) is not installed; "
            "`pip install nvidia-ml-py` on the GPU host",
            file=sys.stderr,
        )
        return 3
    from haru.agents.gpu import NvmlGpus, Owner, account, process_tree, read_parents

    gpus = NvmlGpus()
    if not gpus.available:
        print(
            f"gpu_host: no NVML here: nvmlInit failed ({gpus.unavailable}); this needs an NVIDIA driver "
            f"(libnvidia-ml.so.1). Nothing was measured.",
            file=sys.stderr,
        )
        return 3
    try:
        import torch
    except ImportError:
        print(
            "gpu_host: torch is not installed; the runtime and trainer stand-ins are torch processes", file=sys.stderr
        )
        return 3
    summary: dict = {"gpu": args.gpu, "torch": torch.__version__, "python": platform.python_version()}
    children: list[subprocess.Popen] = []
    try:
        before = gpus.read(args.gpu)
        show(before, f"GPU {args.gpu} before")
        if before.present is not True:
            print(f"gpu_host: NVML answers but GPU {args.gpu} reads present={before.present}", file=sys.stderr)
            return 3
        summary["name"], summary["total_bytes"] = before.name, before.memory_total_bytes

        runtime = start_child(args.runtime_gib, args.gpu)
        children.append(runtime)
        trainer = start_child(args.trainer_gib, args.gpu)
        children.append(trainer)
        time.sleep(0.5)
        both = gpus.read(args.gpu)
        show(both, "with a runtime and a trainer")
        parents = read_parents()
        owners = [
            Owner(
                name="runtime",
                kind="model",
                pids=process_tree({runtime.pid}, parents),
                planned_bytes=int(args.runtime_gib * GiB),
            ),
            Owner(
                name="trainer",
                kind="training",
                pids=process_tree({trainer.pid}, parents),
                planned_bytes=int(args.trainer_gib * GiB),
            ),
        ]
        usage, foreign = account(both.processes, owners, exclude=frozenset({os.getpid()}))
        for u in usage:
            print(
                f"    {u.kind:<8} {u.name:<8} pids {u.pids} holds {gib(u.used_bytes)} (planned {gib(u.planned_bytes)}, "
                f"over plan: {u.over_plan}: the CUDA context is on top of what torch allocated)"
            )
        print(f"    foreign (not started here): {[(f.pid, gib(f.used_bytes)) for f in foreign] or 'none'}")
        summary["accounted"] = both.accounted
        summary["usage"] = [{"name": u.name, "pids": u.pids, "used_bytes": u.used_bytes} for u in usage]
        summary["foreign"] = [{"pid": f.pid, "used_bytes": f.used_bytes} for f in foreign]
        summary["used_delta_bytes"] = both.memory_used_bytes - before.memory_used_bytes

        releases: list[float] = []
        for i in range(args.kills):
            if i:
                if time.monotonic() > deadline - 60:
                    print("gpu_host: stopping the kills early to stay within ~5 minutes")
                    break
                trainer = start_child(args.trainer_gib, args.gpu)
                children.append(trainer)
                time.sleep(0.3)
            held = gpus.read(args.gpu)
            mine = sum(p.used_bytes for p in held.processes if p.pid == trainer.pid)
            t0 = time.monotonic()
            os.killpg(trainer.pid, signal.SIGKILL)
            reads = 0
            while True:
                r = gpus.read(args.gpu)
                reads += 1
                gone = all(p.pid != trainer.pid for p in r.processes)
                freed = held.memory_used_bytes - r.memory_used_bytes >= 0.9 * mine if mine else gone
                if gone and freed:
                    took = (time.monotonic() - t0) * 1000
                    break
                if time.monotonic() - t0 > args.release_timeout_s:
                    took = float("nan")
                    break
                time.sleep(0.01)
            trainer.wait(30)
            releases.append(took)
            print(
                f"kill {i + 1}: trainer pid {trainer.pid} held {gib(mine)}; NVML showed it free after {took:.0f} ms "
                f"({reads} reads)"
            )
        summary["release_ms"] = releases
        done = [x for x in releases if x == x]
        if done:
            print(
                f"memory back after a SIGKILL: median {statistics.median(done):.0f} ms, max {max(done):.0f} ms "
                f"(verify_gpu's settle window, policy verify_settle_ms, defaults to 5000 ms)"
            )

        import pynvml as nvml

        handle = nvml.nvmlDeviceGetHandleByIndex(args.gpu)
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            raw = f"current={current} pending={pending}"
        except nvml.NVMLError as exc:
            raw = f"not supported ({exc})"
        print(f"MIG mode: {raw}; NvmlGpus says mig={both.mig}")
        summary["mig_raw"], summary["mig"] = raw, both.mig

        t = []
        for _ in range(100):
            t0 = time.perf_counter()
            gpus.read(args.gpu)
            t.append((time.perf_counter() - t0) * 1000)
        print(f"one NvmlGpus.read: median {statistics.median(t):.2f} ms, max {max(t):.2f} ms")
        summary["read_ms_median"] = statistics.median(t)
    finally:
        for c in children:
            kill(c)
        gpus.close()
    after = NvmlGpus()
    if after.available:
        show(after.read(args.gpu), f"GPU {args.gpu} after")
        after.close()
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
