"""`haru convert`: a tiny generated safetensors llama model -> GGUF with llama.cpp's own converter, quantized
with llama-quantize to Q4_K_M, then served by `haru serve` with the real llama-server answering chat.

Needs the converter's environment (a venv of ~1.2 GB: torch CPU 2.13.0 from this machine's disk, transformers,
sentencepiece...; ~2 min to make once): `haru convert` makes it under $HARU_HOME/tools on first use; the
tests use $HARU_CONVERT_ENV (made once with `python -m haru.up.convert --make-env DIR`) and skip without
it, unless HARU_REQUIRE_CONVERT=1. llama-quantize: `haru runtime llama --quantize`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from haru.up.convert import env_python
from tests.support import haru
from tests.support.demo import REPO, stop_and_reap
from tests.support.llama import llama_binary
from tests.support.ports import lasting_port
from tests.support.wait import wait_until_sync

pytestmark = [pytest.mark.llama, pytest.mark.timeout(240)]


def converter_python() -> Path:
    env = os.environ.get("HARU_CONVERT_ENV", "")
    py = env_python(Path(env)) if env else None
    if py is None:
        how = (
            "no converter environment: make it once with `python -m haru.up.convert --make-env DIR` and set "
            "HARU_CONVERT_ENV=DIR (~2 min, ~1.2 GB)"
        )
        if os.environ.get("HARU_REQUIRE_CONVERT") == "1":
            pytest.fail(how)
        pytest.skip(how)
    return py


def test_convert_quantize_and_serve(tmp_path):
    py = converter_python()
    binary = llama_binary()
    from haru.agents.runtimes.llama_tools import find_tool

    if find_tool("llama-quantize") is None:
        how = "no llama-quantize: `haru runtime llama --quantize` builds it (~1 min once llama-server is built)"
        if os.environ.get("HARU_REQUIRE_CONVERT") == "1":
            pytest.fail(how)
        pytest.skip(how)
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [str(py), str(REPO / "agents" / "runtimes" / "tiny_hf_model.py"), str(model), "--seed", "3"],
        check=True,
        timeout=120,
    )
    out = tmp_path / "tiny-Q4_K_M.gguf"
    done = haru("convert", str(model), "--quant", "Q4_K_M", "-o", str(out), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()) == out and out.read_bytes()[:4] == b"GGUF"
    assert not list(tmp_path.glob(".tiny-Q4_K_M.gguf.tmp*"))  # nothing half-written left beside it
    from gguf import GGUFReader

    reader = GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert any(t.tensor_type.name == "Q4_K" for t in reader.tensors)

    ready = tmp_path / "ready.json"
    env = {**os.environ, "HARU_HOME": str(tmp_path / "home"), "HARU_NO_UVLOOP": "1", "HARU_LLAMA_SERVER": str(binary)}
    for k in ("HARU_NATS_URL", "HARU_API_TOKEN"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "haru.cli",
            "serve",
            "--model",
            f"converted=gguf:{out}:1",
            "--gpu-memory",
            "8",
            "--runtime-args",
            "--threads 1 --threads-http 1",
            "--nats-port",
            "0",
            "--port",
            str(lasting_port()),
            "--ready-file",
            str(ready),
        ],
        stdout=open(tmp_path / "serve.out", "wb"),
        stderr=open(tmp_path / "serve.err", "wb"),
        env=env,
        cwd=REPO,
    )
    tree: set[int] = set()
    try:
        info = wait_until_sync(
            lambda: ready.exists() and json.loads(ready.read_text()),
            90,
            interval_s=0.25,
            what="haru serve",
            retry_on=(Exception,),
        )
        client = OpenAI(base_url=info["gateway_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = wait_until_sync(
            lambda: client.chat.completions.create(
                model="converted", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
            ),
            90,
            interval_s=0.25,
            what="chat",
            retry_on=(Exception,),
        )
        assert reply.model == "converted" and reply.choices[0].finish_reason in ("length", "stop")
    finally:
        stop_and_reap(proc, tree, wait_s=60)
