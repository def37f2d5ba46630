"""`haru serve --model NAME=[gguf:|safetensors:]PATH_OR_REF:GiB[@CTX] …`: one box, one command (see haru/up/serve.py).

Exit statuses: 0 stopped cleanly, 1 a pull or start-up error, 2 a bad flag, 6 a registry that cannot be
reached, 7 refused (the planner admits none of the models: each is printed `short by` how much).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from haru.cli.common import ExitStatus, add_log_options, add_model_options, configure_logging, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="one box: pull the models, plan a single-domain fleet, and run everything here")
    add_model_options(p)
    p.add_argument("--nats-port", type=int, default=4222, help="port of the embedded nats-server (a free one if taken)")
    p.add_argument("--home", default=None, help="state directory (env HARU_HOME, default ~/.haru)")
    p.add_argument("--host", default=None, help="gateway listen address (env HARU_GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=None, help="gateway port (env HARU_GATEWAY_PORT, default 8700)")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    add_log_options(p, default_level="warning")
    p.set_defaults(handler=run)


def _size(text: str, what: str) -> int:
    from haru.up.serve import ServeError, parse_model_flag

    try:
        return parse_model_flag(f"x=/dev/null:{text}").vram_bytes
    except ServeError:
        raise ServeError(f"{what} {text!r} is not a size; write GiB as a number (24) or with a unit (24GiB)") from None


def runtime_binaries(args: argparse.Namespace, runtimes: set[str]) -> tuple[str, str] | str:
    """(llama-server, vllm) binaries from --binary / --llama-binary / --vllm-binary ('' = the managed
    one), or why the flags cannot be read: --binary names one runtime's executable, so a fleet of both
    runtimes must say which binary is which."""
    llama, vllm = args.llama_binary, args.vllm_binary
    if args.binary:
        if len(runtimes) > 1:
            return (
                f"--binary {args.binary} would be given to both llama-server and vLLM models; name each: "
                f"--llama-binary PATH (GGUF models) and/or --vllm-binary PATH (safetensors models)"
            )
        if "llama_server" in runtimes:
            llama = llama or args.binary
        else:
            vllm = vllm or args.binary
    for flag, path in (("--binary", args.binary), ("--llama-binary", llama), ("--vllm-binary", vllm)):
        if path and not Path(path).exists():
            return f"{flag} {path} does not exist; give the runtime's executable"
    return llama, vllm


async def run(args: argparse.Namespace) -> ExitStatus | int:
    from haru.cli.apply import plan_lines
    from haru.cli.models import status_of
    from haru.core.model_errors import ModelsError
    from haru.core.planner import plan as plan_layout
    from haru.host.natsd import free_port
    from haru.up.compose import UpOptions
    from haru.up.home import haru_home
    from haru.up.serve import ServeError, fleet_layout, gpu_memory_from_nvml, parse_model_flag, prepare, split_args

    configure_logging(args.log_format, args.log_level)
    home = haru_home(args.home)
    try:
        models = model_values(args, home)
    except ServeError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    if not models:
        return fail(
            "no --model given; write e.g. haru serve --model chat=qwen3:0.6b:2@8192 (or hearth's --model NAME "
            "--gguf PATH, or a fleet.conf: --fleet-conf FILE)",
            ExitStatus.USAGE,
        )
    try:
        flags = [parse_model_flag(m) for m in models]
        gpus = "sim" if args.gpu_memory else "nvml"
        memory = _size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else gpu_memory_from_nvml()
        reserve = _size(args.reserve, "--reserve")
        prepared, pulls = await prepare(flags, home=str(home), quants=args.quant, say=_say)
    except ServeError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    except ModelsError as exc:
        return fail(str(exc), status_of(exc))
    binaries = runtime_binaries(args, {p.runtime for p in prepared})
    if isinstance(binaries, str):
        return fail(binaries, ExitStatus.USAGE)
    llama, vllm = binaries
    if not llama and any(p.runtime == "llama_server" for p in prepared):
        from haru.agents.errors import RuntimeBuildFailed
        from haru.agents.runtimes.llama_build import find_binary

        try:
            found = find_binary()
        except RuntimeBuildFailed as exc:
            return fail(str(exc))
        if found is None:
            return fail(
                "no llama-server for the GGUF models: `haru runtime llama` builds it (~10 min on 2 cores, "
                "once) or set HARU_LLAMA_SERVER to one"
            )
        llama = str(found)
    layout = fleet_layout(
        prepared,
        fleet=args.fleet_name,
        gpu_memory=memory,
        reserve=reserve,
        serving_url=f"http://127.0.0.1:{free_port()}",
        llama_binary=llama,
        vllm_binary=vllm,
        runtime_args=split_args(args.runtime_args),
    )
    plan = plan_layout(layout)
    for line in plan_lines(plan):
        _say(line)
    refused = plan.not_admitted()
    if len(refused) == len(plan.verdicts()):
        return fail(
            f"refused: none of the {len(refused)} model(s) fits on this GPU; give them less VRAM, or a "
            "bigger --gpu-memory",
            ExitStatus.REFUSED,
        )
    _say("haru serve: a single-domain fleet: requests go to this box; there is nothing to fail over to")

    async def record_pulls(events, layout) -> None:
        from haru.models.record import fetched_event, record_fetch

        for flag, result in pulls:
            await record_fetch(
                events, layout.fleet, fetched_event(result, model=flag.name, domain="local", by="up:serve")
            )

    opts = UpOptions(
        home=home,
        nats_port=args.nats_port,
        gateway_host=args.host,
        gateway_port=args.port,
        ready_file=Path(args.ready_file) if args.ready_file else None,
        layout=layout,
        agent_gpus=gpus,
        after_apply=record_pulls,
    )
    from haru.cli.up import run_up

    return await run_up(opts)


def model_values(args: argparse.Namespace, home: Path) -> list[str]:
    """Every `--model` value in Haru's syntax, from any of the spellings a user brings: Haru's own
    (`--model NAME=…:GiB`), hearth's `--model NAME --gguf PATH` / `--safetensors DIR`, and hearth's
    fleet.conf (`--fleet-conf FILE`, else $HARU_HOME/fleet.conf when no model is given)."""
    from haru.up.serve import ServeError, hearth_model_flag, parse_fleet_conf

    values = list(args.model)
    if args.gguf or args.safetensors:
        bare = [m for m in values if "=" not in m]
        if len(bare) != 1:
            raise ServeError(
                "--gguf/--safetensors name one model: write --model NAME --gguf PATH (one NAME without '=')"
            )
        values[values.index(bare[0])] = hearth_model_flag(
            bare[0], gguf=args.gguf, safetensors=args.safetensors, vram=args.vram
        )
    elif args.vram:
        raise ServeError("--vram goes with --model NAME --gguf PATH (or --safetensors DIR)")
    conf = Path(args.fleet_conf) if args.fleet_conf else None
    if conf is None and not values and (home / "fleet.conf").is_file():
        conf = home / "fleet.conf"
    if conf is not None:
        try:
            text = conf.read_text()
        except OSError as exc:
            raise ServeError(f"cannot read {conf}: {exc.strerror}; give the path of a fleet.conf") from None
        values += parse_fleet_conf(text, origin=str(conf))
    return values


def _say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
