"""Where llama-server comes from: $HARU_LLAMA_SERVER, else the cache layout, else a build (not run here)."""

from __future__ import annotations

import json
import os

import pytest

from haru.agents.errors import RuntimeBuildFailed
from haru.agents.runtimes import llama_build as lb


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(lb.ENV_BINARY, raising=False)
    return tmp_path / "haru" / "llama.cpp" / lb.VERSION


def put_binary(cache, stamp: dict | None = None):
    (cache / "bin").mkdir(parents=True)
    binary = cache / "bin" / "llama-server"
    binary.write_text("#!/bin/sh\n")
    os.chmod(binary, 0o755)
    if stamp is not None:
        (cache / "bin" / "llama-server.stamp.json").write_text(json.dumps(stamp))
    return binary


def test_the_cache_follows_xdg_cache_home(cache):
    assert lb.cache_dir() == cache
    assert lb.find_binary() is None
    binary = put_binary(cache)  # a build without a stamp (built by hand with the same layout) is used
    assert lb.find_binary() == binary


def test_a_stamp_from_other_flags_means_rebuild(cache):
    put_binary(cache, {"version": lb.VERSION, "flags": ["-DGGML_NATIVE=ON"]})
    assert lb.find_binary() is None
    (cache / "bin" / "llama-server.stamp.json").write_text(json.dumps(lb._stamp()))
    assert lb.find_binary() == cache / "bin" / "llama-server"


def test_the_environment_names_a_binary_or_says_what_is_wrong(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(lb.ENV_BINARY, str(tmp_path / "nope"))
    with pytest.raises(RuntimeBuildFailed, match="HARU_LLAMA_SERVER=.*nope is not an executable"):
        lb.find_binary()
    mine = tmp_path / "my-llama-server"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    monkeypatch.setenv(lb.ENV_BINARY, str(mine))
    assert lb.find_binary() == mine.resolve()


def test_no_binary_and_no_build_says_how_to_build(cache):
    with pytest.raises(RuntimeBuildFailed, match="python -m haru.agents.runtimes.llama_build"):
        lb.ensure_binary(build=False)


def test_the_build_is_pinned_and_gentle():
    assert lb.JOBS == 2 and len(lb.SDIST_SHA256) == 64
    assert "-DBUILD_SHARED_LIBS=OFF" in lb.CMAKE_FLAGS and "-DGGML_NATIVE=OFF" in lb.CMAKE_FLAGS
