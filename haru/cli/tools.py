"""`haru runtime llama` (the managed llama.cpp: build it, or say what is there) and `haru convert` (safetensors
-> GGUF with llama.cpp's own converter and quantizer)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from haru.cli.common import ExitStatus, emit_json, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runtime", help="the managed llama.cpp runtime agents use when a layout names no binary")
    p.add_argument("which", choices=("llama",), help="the runtime (llama: llama.cpp's llama-server)")
    p.add_argument("--check", action="store_true", help="build nothing; exit 3 when llama-server is missing")
    p.add_argument("--quantize", action="store_true", help="also build llama-quantize (for `haru convert --quant`)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_runtime)

    p = sub.add_parser("convert", help="safetensors -> GGUF with llama.cpp's converter (and quantizer)")
    p.add_argument("source", help="a model directory (config.json + *.safetensors) or a .safetensors file")
    p.add_argument("--outtype", default="f16", help="f32, f16, bf16, q8_0, ... (the converter's; default f16)")
    p.add_argument("--quant", default="", help="then quantize with llama-quantize: Q4_K_M, Q5_K_M, Q8_0, ...")
    p.add_argument("--output", "-o", default=None, help="the GGUF to write (default ./<name>-<type>.gguf)")
    p.add_argument("--home", default=None, help="state directory; the converter's venv is under <home>/tools")
    p.set_defaults(handler=run_convert)


def run_runtime(args: argparse.Namespace) -> ExitStatus:
    from haru.agents.runtimes import llama_build as lb
    from haru.agents.runtimes import llama_tools

    if not args.check:
        try:
            llama_tools.ensure_tool("llama-server")  # cmake's own [ NN%] lines on stderr are the progress
            if args.quantize:
                llama_tools.ensure_tool("llama-quantize")
        except lb.BuildError as exc:
            return fail(str(exc))
    info = llama_tools.status()
    if args.json:
        emit_json(info)
    else:
        out = sys.stdout
        out.write(
            f"llama.cpp {info['version']} ({info['package']} sdist, sha256 {info['sdist_sha256'][:12]}…), "
            f"cache {info['cache']}\n"
        )
        for name, t in info["tools"].items():
            where = t["path"] or (
                t.get("error") or f"not built (`haru runtime llama{' --quantize' if name == 'llama-quantize' else ''}`)"
            )
            extra = f"  ({t['reports']})" if t.get("reports") else ""
            out.write(f"  {name:<15} {where}{extra}\n")
            if name == "llama-server":
                if t.get("backend"):
                    out.write(f"  {'':<15} from {t['from']}: {t['backend']}\n")
                out.write(f"  {'':<15} this host builds: {t['host_backend']}\n")
                out.write(f"  {'':<15} on PATH: {t['on_path']}\n")
        out.write(f"  {'converter':<15} {info['converter'] or 'not fetched'}\n")
    if info["tools"]["llama-server"]["path"] is None:
        return ExitStatus.NOT_FOUND
    return ExitStatus.OK


def run_convert(args: argparse.Namespace) -> ExitStatus:
    from haru.up.convert import ConvertError, convert

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if not Path(args.source).exists():  # a path that does not exist is a usage error (docs/cli.md's table)
        return fail(
            f"{args.source} does not exist; give a model directory (config.json + *.safetensors) or a "
            f".safetensors file beside its config.json",
            ExitStatus.USAGE,
        )
    try:
        out = convert(
            Path(args.source),
            outtype=args.outtype,
            quant=args.quant,
            output=Path(args.output) if args.output else None,
            home=args.home,
            say=say,
        )
    except ConvertError as exc:
        return fail(str(exc))
    print(out)
    return ExitStatus.OK
