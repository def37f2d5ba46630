"""`haru sim ...`: inject faults into the simulated GPU hosts by hand.

    haru sim status [<domain>] [--json]
    haru sim add-gpu <domain> [--gpu N] [--memory 24GiB] [--name NAME]
    haru sim detach-gpu <domain> [--gpu N]          the provider takes the GPU away
    haru sim attach-gpu <domain> [--gpu N]          ... and gives it back
    haru sim xid <domain> <xid> [--gpu N]           NVML reports a critical XID (0 clears it)
    haru sim ecc <domain> [--double-bit N] [--pending] [--clear] [--gpu N]   ECC faults as NVML reports them
    haru sim kill-runtime <domain> <model>          SIGKILL the runtime process
    haru sim evict <domain> <model>                 the engine drops the model, the process stays
    haru sim hang <domain> <model>                  the runtime stops answering
    haru sim oom-on-wake <domain> <model>           the next wake fails with CUDA out of memory
    haru sim fail-probe <domain> <model>            completions fail with 500 until reset
    haru sim reset <domain> <model>                 clear hang, fail-probe and oom-on-wake
    haru sim finish-run <domain> [--diverged]       the simulated trainer ends its run: its agent publishes
                                                    the adapter (a diverged run's answers garbage)

Every simulated host (domain) is a directory `<sim root>/<domain>/`; the sim root is --sim-root,
else $HARU_SIM_ROOT, else $HARU_HOME/sim (HARU_HOME defaults to ~/.haru).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from haru.agents.sim import trainer_files
from haru.agents.sim.errors import SimError
from haru.agents.sim.gpu_state import SimGpuState, gpu_indexes, parse_size
from haru.agents.sim.vllm import runtime_path
from haru.cli.common import ExitStatus, emit_json, fail
from haru.core.sizes import format_size
from haru.core.subjects import check_name, model_from_token
from haru.host.procfs import pid_alive

_FAULTS = {
    "evict": "evict",
    "hang": "hang",
    "oom-on-wake": "oom_on_wake",
    "fail-probe": "fail_probe",
    "reset": "reset",
    "crash": "crash",
}
FINISH_WAIT_S = 10.0  # a simulated trainer looks for the request every step (50 ms by default)


def default_sim_root() -> Path:
    if os.environ.get("HARU_SIM_ROOT"):
        return Path(os.environ["HARU_SIM_ROOT"])
    home = Path(os.environ.get("HARU_HOME") or Path.home() / ".haru")
    return home / "sim"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="inject faults into simulated GPU hosts",
        description="Inspect and break the simulated GPU hosts (agents/sim).",
    )
    sub = parser.add_subparsers(dest="sim_command", metavar="<sim command>")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--sim-root",
            type=Path,
            default=None,
            help="root of the simulated hosts (env HARU_SIM_ROOT; default $HARU_HOME/sim)",
        )

    status = sub.add_parser("status", help="print simulated GPUs and runtimes")
    status.add_argument("domain", nargs="?")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    common(status)
    status.set_defaults(handler=run_status)

    add = sub.add_parser("add-gpu", help="create a simulated GPU (no-op if it exists)")
    add.add_argument("domain")
    add.add_argument("--gpu", type=int, default=0)
    add.add_argument("--memory", default="24GiB", help="total memory (default %(default)s)")
    add.add_argument("--name", default="Haru Sim GPU")
    common(add)
    add.set_defaults(handler=run_add_gpu)

    for verb, present, what in (
        ("detach-gpu", False, "detach a simulated GPU (the provider took it)"),
        ("attach-gpu", True, "attach a detached simulated GPU again"),
    ):
        p = sub.add_parser(verb, help=what)
        p.add_argument("domain")
        p.add_argument("--gpu", type=int, default=0)
        common(p)
        p.set_defaults(handler=run_presence, present=present)

    xid = sub.add_parser("xid", help="NVML reports a critical XID on a simulated GPU (0 clears it)")
    xid.add_argument("domain")
    xid.add_argument("xid", type=int)
    xid.add_argument("--gpu", type=int, default=0)
    common(xid)
    xid.set_defaults(handler=run_signs)
    ecc = sub.add_parser("ecc", help="NVML reports ECC faults on a simulated GPU")
    ecc.add_argument("domain")
    ecc.add_argument("--double-bit", type=int, default=None, help="uncorrected (double-bit) volatile ECC errors")
    ecc.add_argument("--pending", action="store_true", help="retired pages pending (the GPU needs a reset)")
    ecc.add_argument("--clear", action="store_true", help="no ECC faults")
    ecc.add_argument("--gpu", type=int, default=0)
    common(ecc)
    ecc.set_defaults(handler=run_signs, xid=None)

    kill = sub.add_parser("kill-runtime", help="SIGKILL a simulated runtime")
    kill.add_argument("domain")
    kill.add_argument("model")
    common(kill)
    kill.set_defaults(handler=run_kill)

    helps = {
        "evict": "the engine drops the model (the process stays alive)",
        "hang": "the runtime stops answering health and completions",
        "oom-on-wake": "the next wake fails with CUDA out of memory",
        "fail-probe": "completions fail with 500 until reset",
        "reset": "clear hang, fail-probe and oom-on-wake",
        "crash": "the runtime exits at once with a non-zero status",
    }
    for verb, fault in _FAULTS.items():
        p = sub.add_parser(verb, help=helps[verb])
        p.add_argument("domain")
        p.add_argument("model")
        common(p)
        p.set_defaults(handler=run_fault, fault=fault)

    _register_finish_run(sub, common)


def _register_finish_run(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """`haru sim finish-run`: the simulated trainer ends its run (the adapter loop of docs/adapters.md)."""
    finish = sub.add_parser(
        "finish-run",
        help="the simulated trainer of a domain ends its run now; its agent publishes the adapter",
        description="The simulated trainer running on the domain ends its run as a real one does: it writes its "
        "adapter and publish.json and exits 0, and the domain's agent publishes the adapter (docs/adapters.md).",
    )
    finish.add_argument("domain")
    finish.add_argument(
        "--diverged", action="store_true", help="the run diverged: its adapter answers garbage and fails its probe"
    )
    common(finish)
    finish.set_defaults(handler=run_finish)


def _host_dir(args: argparse.Namespace, domain: str) -> Path:
    root = args.sim_root or default_sim_root()
    return root / check_name("domain", domain)


def run_add_gpu(args: argparse.Namespace) -> ExitStatus:
    try:
        total = parse_size(args.memory)
    except SimError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    state = SimGpuState(_host_dir(args, args.domain), args.gpu).ensure(total, args.name)
    print(f"sim GPU {args.gpu} of domain {args.domain}: {state['name']}, {format_size(state['memory_total_bytes'])}")
    return ExitStatus.OK


def run_presence(args: argparse.Namespace) -> ExitStatus:
    gpu = SimGpuState(_host_dir(args, args.domain), args.gpu)
    if not gpu.exists():
        return fail(
            f"domain {args.domain!r} has no simulated GPU {args.gpu} ({gpu.path}); "
            f"check the domain and --gpu, or create it with `haru sim add-gpu {args.domain} --gpu {args.gpu}`",
            ExitStatus.NOT_FOUND,
        )
    gpu.set_present(args.present)
    print(f"sim GPU {args.gpu} of domain {args.domain} {'attached' if args.present else 'detached'}")
    return ExitStatus.OK


def run_signs(args: argparse.Namespace) -> ExitStatus:
    gpu = SimGpuState(_host_dir(args, args.domain), args.gpu)
    if not gpu.exists():
        return fail(
            f"domain {args.domain!r} has no simulated GPU {args.gpu} ({gpu.path}); check the domain and --gpu",
            ExitStatus.NOT_FOUND,
        )
    if args.xid is not None:
        gpu.set_signs(xid=args.xid)
        print(
            f"sim GPU {args.gpu} of domain {args.domain}: critical XID {args.xid}"
            if args.xid
            else f"sim GPU {args.gpu} of domain {args.domain}: XID cleared"
        )
        return ExitStatus.OK
    if getattr(args, "clear", False):
        gpu.set_signs(ecc_uncorrected=0, pages_pending=False)
    else:
        gpu.set_signs(ecc_uncorrected=args.double_bit, pages_pending=True if args.pending else None)
    state = gpu.read()
    print(
        f"sim GPU {args.gpu} of domain {args.domain}: {state['ecc_uncorrected']} uncorrected ECC errors, "
        f"pages pending retirement: {'yes' if state['pages_pending'] else 'no'}"
    )
    return ExitStatus.OK


def _runtime(args: argparse.Namespace) -> dict | ExitStatus:
    path = runtime_path(_host_dir(args, args.domain), args.model)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return fail(
            f"no simulated runtime serves {args.model!r} in domain {args.domain!r} ({path}); "
            f"see `haru sim status {args.domain}`",
            ExitStatus.NOT_FOUND,
        )


def run_kill(args: argparse.Namespace) -> ExitStatus:
    rt = _runtime(args)
    if isinstance(rt, ExitStatus):
        return rt
    try:
        os.kill(int(rt["pid"]), signal.SIGKILL)
    except ProcessLookupError:
        return fail(f"runtime of {args.model!r} (pid {rt['pid']}) is not running", ExitStatus.NOT_FOUND)
    print(f"killed runtime of {args.model!r} in domain {args.domain} (pid {rt['pid']}, SIGKILL)")
    return ExitStatus.OK


def _post(rt: dict, path: str, timeout: float = 2.0) -> dict:
    url = f"http://{rt.get('host', '127.0.0.1')}:{rt['port']}{path}"
    request = urllib.request.Request(url, method="POST" if not path.endswith("/state") else "GET", data=None)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def run_fault(args: argparse.Namespace) -> ExitStatus:
    rt = _runtime(args)
    if isinstance(rt, ExitStatus):
        return rt
    try:
        _post(rt, f"/_sim/{args.fault}")
    except (urllib.error.URLError, OSError) as exc:
        return fail(
            f"runtime of {args.model!r} in domain {args.domain} (port {rt['port']}) did not answer: {exc}; "
            "it may still be loading or be dead (see `haru sim status`)",
            ExitStatus.UNAVAILABLE,
        )
    print(f"{args.fault} injected into {args.model!r} in domain {args.domain}")
    return ExitStatus.OK


def run_finish(args: argparse.Namespace) -> ExitStatus:
    host = _host_dir(args, args.domain)
    running = trainer_files.trainers(host)
    if not running:
        return fail(
            f"no simulated trainer runs on domain {args.domain!r} ({host}): training runs only on a standby, and a "
            f"finished run's slot waits for the next demotion; see `haru status`, and start it with "
            f"`haru demote {args.domain}`",
            ExitStatus.NOT_FOUND,
        )
    for t in running:
        if not t.get("adapter"):
            return fail(
                f"the simulated trainer of domain {args.domain} (pid {t['pid']}) trains no adapter, so its run "
                "has nothing to publish: give its training command --base-model MODEL --adapter NAME",
                ExitStatus.USAGE,
            )
    for t in running:
        trainer_files.ask_finish(host, int(t["pid"]), diverged=args.diverged)
    deadline = time.monotonic() + FINISH_WAIT_S
    while any(pid_alive(int(t["pid"])) for t in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for t in running:
        if pid_alive(int(t["pid"])):
            return fail(
                f"the simulated trainer of domain {args.domain} (pid {t['pid']}) did not finish within "
                f"{FINISH_WAIT_S:.0f} s; its own words are in the agent's log of the slot "
                "(<state dir>/training-<slot>.log)",
                ExitStatus.ERROR,
            )
        how = ", diverged" if args.diverged else ""
        print(
            f"sim trainer of domain {args.domain} (pid {t['pid']}) finished run {t['run']}{how}: "
            f"adapter {t['base_model']}:{t['adapter']}, for its agent to publish"
        )
    return ExitStatus.OK


def _status_of(host: Path) -> dict:
    gpus = []
    for index in gpu_indexes(host):
        try:
            gpus.append(SimGpuState(host, index).read())
        except (SimError, OSError, ValueError) as exc:
            gpus.append({"index": index, "error": str(exc)})
    runtimes = []
    for path in sorted(host.glob("runtime-*.json")):
        try:
            rt = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rt.setdefault("model", model_from_token(path.stem.removeprefix("runtime-")))
        rt["alive"] = pid_alive(int(rt.get("pid", 0)))
        rt["state"] = None
        if rt["alive"]:
            try:
                rt["state"] = _post(rt, "/_sim/state", timeout=0.5)
            except (urllib.error.URLError, OSError, ValueError):
                rt["state"] = "loading or not answering"
        runtimes.append(rt)
    return {"domain": host.name, "dir": str(host), "gpus": gpus, "runtimes": runtimes}


def run_status(args: argparse.Namespace) -> ExitStatus:
    root = args.sim_root or default_sim_root()
    if args.domain:
        hosts = [_host_dir(args, args.domain)]
        if not hosts[0].is_dir():
            return fail(
                f"no simulated host {args.domain!r} under {root}; check the name or --sim-root", ExitStatus.NOT_FOUND
            )
    else:
        hosts = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    report = [_status_of(host) for host in hosts]
    if args.json:
        emit_json(report)
        return ExitStatus.OK
    if not report:
        print(f"no simulated hosts under {root}")
    for host in report:
        print(f"domain {host['domain']}  ({host['dir']})")
        for gpu in host["gpus"]:
            if "error" in gpu:
                print(f"  gpu {gpu['index']}: unreadable: {gpu['error']}")
                continue
            presence = "present" if gpu["present"] else "DETACHED"
            print(
                f"  gpu {gpu['index']}: {gpu['name']}, {presence}, used {format_size(gpu['memory_used_bytes'])} "
                f"of {format_size(gpu['memory_total_bytes'])} (free {format_size(gpu['memory_free_bytes'])})"
            )
            for pid, n in gpu["allocations"].items():
                print(f"    pid {pid}: {format_size(n)}")
        for rt in host["runtimes"]:
            state = rt["state"]
            if not rt["alive"]:
                what = "DEAD"
            elif isinstance(state, dict):
                flags = [k for k in ("sleeping", "evicted", "hung", "fail_probe", "oom_on_wake") if state.get(k)]
                what = "serving" if not flags else ", ".join(flags)
                if not state.get("gpu_present", True):
                    what += ", GPU lost"
            else:
                what = str(state)
            print(f"  runtime {rt['model']!r}: pid {rt.get('pid')}, port {rt.get('port')}, {what}")
    return ExitStatus.OK
