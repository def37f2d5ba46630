"""End to end: `haru serve --model tiny=tiny:1b:1@512` pulls a GGUF from a registry on 127.0.0.1, plans a
single-domain fleet, and a real llama-server answers chat through the gateway; `haru status`, `why`
and `verify` work as with two domains; SIGTERM leaves no process behind. And a model that cannot fit
is refused before anything starts, in hearth's words, with exit status 7."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from openai import OpenAI

from tests.support import haru
from tests.support.demo import REPO, descendants, stop_and_reap
from tests.support.llama import llama_binary
from tests.support.models_registry import build_registry
from tests.support.ports import lasting_port
from tests.support.wait import wait_until_sync


@pytest.fixture
def registry_url(tmp_path):
    reg = build_registry(tmp_path / "reg")
    port = lasting_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.support.models_registry", "--root", str(reg.root), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        p.kill()
        p.wait()


@pytest.mark.llama
@pytest.mark.timeout(180)
def test_serve_pulls_a_reference_and_a_real_llama_server_answers(registry_url, tmp_path):
    llama = llama_binary()
    home = tmp_path / "home"
    ready = tmp_path / "ready.json"
    env = {
        **os.environ,
        "HARU_HOME": str(home),
        "HARU_NO_UVLOOP": "1",
        "HARU_LLAMA_SERVER": str(llama),
        "HF_ENDPOINT": registry_url,
        "HARU_OLLAMA_REGISTRY": registry_url,
    }
    for k in ("HARU_NATS_URL", "HARU_API_TOKEN"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "haru.cli",
            "serve",
            "--model",
            "tiny=tiny:1b:1@512",
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
            "--log-level",
            "info",
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
            what="haru serve to be ready",
            retry_on=(Exception,),
        )
        out = (tmp_path / "serve.out").read_text()
        assert "haru serve: pulling tiny:1b for tiny" in out
        assert "tiny                         admitted (1.0 GiB)" in out
        assert "nothing to fail over to" in out
        client = OpenAI(base_url=info["gateway_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = wait_until_sync(
            lambda: client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
            ),
            90,
            interval_s=0.25,
            what="chat through the gateway",
            retry_on=(Exception,),
        )
        assert reply.model == "tiny" and reply.choices[0].finish_reason in ("length", "stop")
        tree |= descendants(proc.pid)
        assert any(_exe(p) == "llama-server" for p in tree)
        nats = info["nats_url"]
        status = haru("status", nats_url=nats)
        assert status.returncode == 0 and "local" in status.stdout and "resident" in status.stdout, status.stdout
        why = haru("why", "tiny", nats_url=nats)
        assert why.returncode == 0 and "fetched" in why.stdout and "resident" in why.stdout, why.stdout
        assert "model.gguf" in why.stdout
        verify = haru("verify", nats_url=nats)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        run = subprocess.run(
            [sys.executable, "-m", "haru.cli", "run", "tiny", "--url", info["gateway_url"], "--max-tokens", "4"],
            input="hello\n/exit\n",
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
        # the model file the runtime reads is the store's, verified, under HARU_HOME
        snapshot = next((home / "models" / "snapshots").iterdir())
        assert (snapshot / "model.gguf").resolve().parent == home / "models" / "blobs"
    finally:
        left = stop_and_reap(proc, tree, wait_s=60)
    assert proc.returncode == 0, (tmp_path / "serve.err").read_text()[-2000:]
    assert not left


def _exe(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def test_serve_refuses_what_cannot_fit_before_starting_anything(tmp_path):
    from haru.agents.runtimes.tiny_model import write_tiny_model

    gguf = write_tiny_model(tmp_path / "m.gguf", seed=1)
    env = {"HARU_HOME": str(tmp_path / "home"), "HARU_LLAMA_SERVER": sys.executable}
    proc = haru("serve", "--model", f"big=gguf:{gguf}:30", "--gpu-memory", "24", "--nats-port", "0", env=env)
    assert proc.returncode == 7, proc.stderr
    assert "big                          not admitted — short by 7.0 GiB" in proc.stdout
    assert "refused: none of the 1 model(s) fits" in proc.stderr
    assert not (tmp_path / "home" / "nats").exists()  # nothing was started
    bad = haru("serve", "--model", "x=./nope.gguf:2", "--gpu-memory", "8", env=env)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    from haru.agents.gpu import NvmlGpus

    gpus = NvmlGpus()
    has_gpu = gpus.read(0).present is True
    gpus.close()
    if not has_gpu:  # this machine: no GPU, so --gpu-memory is the way, and the message says so
        nogpu = haru("serve", "--model", f"m=gguf:{gguf}:1", env=env)
        assert nogpu.returncode == 2 and "pass --gpu-memory GiB" in nogpu.stderr
    syntax = haru("serve", "--model", "x", env=env)
    assert syntax.returncode == 2 and "NAME=[gguf:|safetensors:]PATH_OR_REF:GiB[@CTX]" in syntax.stderr
