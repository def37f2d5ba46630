"""`haru run` checks the model before the REPL opens, and Ctrl-D on a terminal leaves the prompt clean."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from haru.core.residency import Answer
from tests.support.gateway_cli import MODEL, haru_gateway, publish, run_repl, sim_vllm


@pytest.mark.timeout(90)
async def test_an_unknown_model_is_refused_before_the_prompt_and_ctrl_d_ends_on_a_new_line(
    event_log, nats_server, tmp_path
):
    async with (
        sim_vllm(tmp_path / "sim", "a") as sim_url,
        haru_gateway(nats_server.url, tmp_path, HARU_DEFAULT_FLEET="cli") as (gw_url, _proc, _log),
    ):
        await publish(event_log, "cli", sim_url, Answer(answer="ready"))
        deadline = time.monotonic() + 10
        while True:  # the gateway has read the view
            code, out, err = await run_repl(gw_url, "")
            if code == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert code == 0, err
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "haru.cli",
            "run",
            "no-such-model",
            "--url",
            gw_url,
            "--fleet",
            "cli",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(b"hello\n"), 30)
        assert proc.returncode == 3, err
        assert f"no model 'no-such-model' behind {gw_url}" in err.decode() and MODEL in err.decode()
        assert out == b""  # no prompt, nothing sent
        transcript = await asyncio.to_thread(_ctrl_d_on_a_terminal, gw_url)
    assert transcript.endswith(b">>> \r\n"), transcript


def _ctrl_d_on_a_terminal(url: str) -> bytes:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "haru.cli", "run", MODEL, "--url", url, "--fleet", "cli"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )  # a terminal
    os.close(slave)
    got = b""
    deadline = time.monotonic() + 20
    try:
        while b">>> " not in got and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                got += os.read(master, 1024)
        os.write(master, b"\x04")  # Ctrl-D
        proc.wait(20)
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 1024)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 0
    return got
