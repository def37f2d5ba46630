"""What llama_build and vllm_env share (agents/runtimes/cached.py): the command line, and one maker
waiting for another instead of making the thing twice."""

from __future__ import annotations

import fcntl
import threading
import time

from haru.agents.runtimes import cached, llama_build, vllm_env


def test_check_prints_what_is_there_or_says_what_is_missing_with_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(llama_build.ENV_BINARY, raising=False)
    monkeypatch.delenv(vllm_env.ENV_PYTHON, raising=False)
    assert llama_build.main(["--check"]) == 1
    assert vllm_env.main(["--check"]) == 1
    err = capsys.readouterr()
    assert err.out == ""
    assert "llama-build: no llama-server" in err.err and "vllm-env: no vLLM" in err.err
    mine = tmp_path / "my-llama-server"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    monkeypatch.setenv(llama_build.ENV_BINARY, str(mine))
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv(vllm_env.ENV_PYTHON, str(python))
    assert llama_build.main(["--check"]) == 0 and vllm_env.main(["--check"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(mine.resolve()), f"{python} -m {vllm_env.API_SERVER}"]


def test_a_maker_that_waited_for_another_uses_what_the_other_made(tmp_path, capsys):
    lock_path = tmp_path / "cache" / "make.lock"
    lock_path.parent.mkdir()
    made: list[str] = []
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another maker is at work
        result: list[str] = []
        waiter = threading.Thread(
            target=lambda: result.append(
                cached.made_once("test", lock_path, lambda: made[0] if made else None, lambda: "made twice")
            )
        )
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()  # it waits for the lock
        made.append("made by the other")
    waiter.join(5)
    assert result == ["made by the other"]
    assert "another maker holds" in capsys.readouterr().err
    assert cached.made_once("test", tmp_path / "new" / "make.lock", lambda: None, lambda: "made") == "made"
