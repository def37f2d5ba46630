"""Fixtures shared by this folder's test modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from haru.host.natsd import free_port
from tests.support.demo import REPO, demo_layout_with_free_ports, stop_and_reap
from tests.support.wait import wait_until_sync


@pytest.fixture
def demo(tmp_path):
    home = tmp_path / "home"
    ready = tmp_path / "ready.json"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1"}
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_API_TOKEN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "haru.cli",
            "up",
            "--demo",
            "--nats-port",
            "0",
            "--port",
            str(free_port()),
            "--layout",
            str(layout),
            "--ready-file",
            str(ready),
            "--log-level",
            "info",
        ],
        stdout=open(tmp_path / "up.out", "wb"),
        stderr=open(tmp_path / "up.err", "wb"),
        env=env,
        cwd=REPO,
    )
    tree: set[int] = set()
    try:
        info = wait_until_sync(
            lambda: ready.exists() and json.loads(ready.read_text()),
            60,
            interval_s=0.25,
            what="haru up to be ready",
            retry_on=(Exception,),
        )
        info["home"] = home
        info["env"] = env
        info["proc"] = proc
        info["tree"] = tree
        yield info
    finally:
        stop_and_reap(proc, tree, wait_s=60)
