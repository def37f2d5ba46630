"""`haru serve`: one box, one command. hearth's model flags, a single-domain fleet planned from them,
references pulled first, then `haru up` with that fleet and one agent.

    haru serve --model chat=qwen3:0.6b:2@8192 --model big=gguf:/models/big.gguf:20

`--model NAME=[gguf:|safetensors:]PATH_OR_REF:GiB[@CTX]`:
    NAME           the OpenAI model id clients send
    gguf:/…        the format, optional: `.gguf` files are GGUF, a directory with config.json is safetensors
    PATH_OR_REF    a file or directory here, or a reference (`qwen3:0.6b`, `hf:ORG/REPO[:QUANT]`), pulled
                   into $HARU_HOME/models first
    GiB            the VRAM the planner books for it (a number of GiB, or a size with a unit: `512MiB`)
    @CTX           the context length

The fleet: one domain (`local`), one GPU (NVML's GPU 0, or `--gpu-memory GiB` for a simulated one, which
is how a box without an NVIDIA GPU runs the runtimes on its CPU), every model in one slot. The
planner's refusals are printed in hearth's words (`not admitted — short by 14.8 GiB`); when nothing
is admitted `haru serve` exits with status 7 (refused) before starting anything.

`parse_model_flag` and `fleet_layout` are pure; `prepare` does the pulls.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from haru.core.errors import HaruError
from haru.core.layout import parse_layout
from haru.core.refs import is_reference
from haru.core.sizes import GiB, parse_size
from haru.core.specs import Layout

DOMAIN = "local"
SLOT = "chat"
FLAG_SYNTAX = "NAME=[gguf:|safetensors:]PATH_OR_REF:GiB[@CTX]"


class ServeError(HaruError, ValueError):
    """A `--model` flag or a `haru serve` setting that cannot be used (the operator's)."""


@dataclass(frozen=True)
class ModelFlag:
    name: str
    source: str  # a path or a reference, as written
    vram_bytes: int
    context: int = 0
    format: str = ""  # '' = from the file, or what the reference resolves to

    @property
    def is_reference(self) -> bool:
        return is_reference(self.source)


@dataclass(frozen=True)
class Prepared:
    flag: ModelFlag
    path: str
    format: str  # gguf | safetensors
    runtime: str  # llama_server | vllm


def parse_model_flag(text: str) -> ModelFlag:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ServeError(f"--model {text!r}: write --model {FLAG_SYNTAX}, e.g. --model chat=qwen3:0.6b:2@8192")
    fmt = ""
    for prefix in ("gguf:", "safetensors:"):
        if rest.startswith(prefix):
            fmt, rest = prefix[:-1], rest[len(prefix) :]
    source, sep, size = rest.rpartition(":")
    if not sep or not source:
        raise ServeError(
            f"--model {text!r}: no VRAM size after the last ':'; write --model {name}={rest}:GiB (e.g. :2 for 2 GiB)"
        )
    size, _, ctx = size.partition("@")
    try:
        vram = int(float(size) * GiB) if re.fullmatch(r"\d+(\.\d*)?", size) else parse_size(size)
    except Exception:  # noqa: BLE001 - parse_size raises LayoutError with a JSON path; say it for a flag
        raise ServeError(
            f"--model {text!r}: {size!r} is not a VRAM size; write GiB as a number (2, 1.5) or a "
            "size with a unit (512MiB)"
        ) from None
    if vram <= 0:
        raise ServeError(f"--model {text!r}: the VRAM size must be more than 0")
    context = 0
    if ctx:
        if not ctx.isdigit() or int(ctx) <= 0:
            raise ServeError(f"--model {text!r}: {ctx!r} after '@' is not a context length; write e.g. @8192")
        context = int(ctx)
    return ModelFlag(name=name, source=source, vram_bytes=vram, context=context, format=fmt)


def local_format(path: Path, declared: str) -> str:
    """GGUF or safetensors, from what is on disk (and the flag's prefix, which must agree)."""
    if not path.exists():
        raise ServeError(
            f"{path} does not exist; give a .gguf file, a safetensors model directory, or a reference "
            "such as qwen3:0.6b or hf:ORG/REPO"
        )
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        found = "gguf" if magic == b"GGUF" else ""
        if not found:
            raise ServeError(
                f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF'); a safetensors "
                "model is served as its directory (config.json + *.safetensors)"
            )
    else:
        if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
            raise ServeError(
                f"{path} is a directory without config.json and *.safetensors; it is not a model vLLM can load"
            )
        found = "safetensors"
    if declared and declared != found:
        raise ServeError(f"{path} is {found}, but the flag says {declared}:; drop the prefix or fix the path")
    return found


def fleet_layout(
    prepared: list[Prepared],
    *,
    fleet: str,
    gpu_memory: int,
    reserve: int,
    serving_url: str,
    llama_binary: str = "",
    runtime_args: list[str] | None = None,
    policy: dict | None = None,
    vllm_binary: str = "",
) -> Layout:
    """The single-domain fleet of `haru serve`, validated as any layout is."""
    models = []
    for p in prepared:
        m: dict = {"name": p.flag.name, "runtime": p.runtime, "vram": p.flag.vram_bytes, "source": p.path}
        if p.flag.context:
            m["context_length"] = p.flag.context
        args = list(runtime_args or [])
        if p.runtime == "vllm" and vllm_binary:
            m["binary"] = [vllm_binary]
        if p.runtime == "llama_server":
            if llama_binary:
                m["binary"] = [llama_binary]
            if p.flag.context:
                args = ["--ctx-size", str(p.flag.context), *args]
        if args:
            m["args"] = args
        models.append(m)
    doc = {
        "fleet": fleet,
        "policy": policy or {},
        "domains": [
            {
                "name": DOMAIN,
                "serving_url": serving_url,
                "gpus": [{"index": 0, "memory": gpu_memory, "reserve": reserve}],
                "slots": [{"name": SLOT, "gpu": 0, "models": models}],
            }
        ],
    }
    return parse_layout(doc)


async def prepare(
    flags: list[ModelFlag], *, home: str | None, quants: str = "", progress: bool | None = None, say=print
) -> tuple[list[Prepared], list]:
    """Each flag's path and format: references pulled (with a progress bar on a terminal). Returns the
    prepared models and the PullResults (to record once the log is up)."""
    from haru.cli.models import pull_reference

    out: list[Prepared] = []
    pulls = []
    names = [f.name for f in flags]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ServeError(f"model {dupes[0]!r} is given twice; each --model needs its own NAME")
    for f in flags:
        if f.is_reference:
            say(f"haru serve: pulling {f.source} for {f.name}")
            result = await pull_reference(f.source, home=home, quants=quants, progress=progress, label=f.name)
            res = result.resolution
            if f.format and f.format != res.format:
                raise ServeError(f"{f.source} resolves to {res.format}, but the flag says {f.format}:")
            pulls.append((f, result))
            say(
                f"haru serve: {f.name} = {result.path} ({res.format}, "
                + (f"fetched {result.fetched_bytes} bytes)" if result.fetched_bytes else "already in the store)")
            )
            out.append(Prepared(flag=f, path=str(result.path), format=res.format, runtime=res.runtime))
        else:
            path = Path(os.path.expanduser(f.source.removeprefix("file:"))).resolve()
            fmt = local_format(path, f.format)
            out.append(
                Prepared(flag=f, path=str(path), format=fmt, runtime="llama_server" if fmt == "gguf" else "vllm")
            )
    return out, pulls


def gpu_memory_from_nvml() -> int:
    """GPU 0's memory from NVML, or ServeError saying how to run without one."""
    from haru.agents.gpu import NvmlGpus

    gpus = NvmlGpus()
    try:
        reading = gpus.read(0)
    finally:
        gpus.close()
    if reading.present is not True:
        why = gpus.unavailable or "no GPU 0"
        raise ServeError(
            f"no NVIDIA GPU seen through NVML ({why}); pass --gpu-memory GiB to plan against a "
            "simulated GPU of that size (the runtimes then run on the CPU)"
        )
    return reading.memory_total_bytes


def split_args(text: str) -> list[str]:
    return shlex.split(text) if text else []


# ------------------------------------------------------------------- hearth's spellings of the same thing

# VRAM booked for a model given without a size (hearth's `serve --model NAME --gguf PATH`): its weights
# on disk, plus this share for the KV cache and the runtime's own buffers, rounded up to 0.1 GiB.
WEIGHTS_HEADROOM = 0.25


def weights_bytes(path: Path) -> int:
    """The size of a model's weights on disk: a GGUF file, or a directory's *.safetensors (or *.gguf)."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".gguf") and p.is_file())
    return 0


def booked_vram(weights: int) -> str:
    """The VRAM booked for `weights` bytes of weights, as a `--model` size (GiB, one decimal, rounded up)."""
    tenths = -(-int(weights * (1 + WEIGHTS_HEADROOM) * 10) // GiB)
    return f"{max(tenths, 1) / 10:.1f}"


def hearth_model_flag(name: str, *, gguf: str = "", safetensors: str = "", vram: str = "", context: int = 0) -> str:
    """hearth's `serve --model NAME --gguf PATH` (or `--safetensors DIR`) written in Haru's `--model`
    syntax. Without `vram` the weights' size on disk plus WEIGHTS_HEADROOM is booked."""
    if bool(gguf) == bool(safetensors):
        raise ServeError(
            f"--model {name}: give exactly one of --gguf PATH or --safetensors DIR (hearth's spelling), "
            f"or write --model {FLAG_SYNTAX}"
        )
    fmt, path = ("gguf", gguf) if gguf else ("safetensors", safetensors)
    if not Path(path).exists():
        raise ServeError(
            f"{path} does not exist; give a .gguf file (--gguf) or a safetensors model directory (--safetensors)"
        )
    size = vram or booked_vram(weights_bytes(Path(path)))
    return f"{name}={fmt}:{path}:{size}" + (f"@{context}" if context else "")


# hearth's fleet.conf: one model a line, `model NAME=[gguf:|safetensors:]PATH:GiB[@CTX]` (the `--model`
# syntax after the word `model`); blank lines and `#` comments are skipped.
def parse_fleet_conf(text: str, origin: str = "fleet.conf") -> list[str]:
    """The `--model` values a fleet.conf declares, in its order (declaration order is priority order)."""
    out: list[str] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = "" if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word != "model" or not rest:
            raise ServeError(
                f"{origin} line {n}: {raw.strip()!r} is not a model line; write "
                f"`model {FLAG_SYNTAX}` (e.g. model muse=/models/muse.gguf:20)"
            )
        parse_model_flag(rest)  # the same checks, with the line's own text in the message
        out.append(rest)
    if not out:
        raise ServeError(f"{origin} declares no model; write one `model {FLAG_SYNTAX}` line per model")
    return out
