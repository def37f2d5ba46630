"""Fixtures shared by this folder's test modules."""

from __future__ import annotations

import os

import pytest

from tests.support.demo import demo_layout_with_free_ports, launch_up, stop_and_reap, wait_ready


@pytest.fixture
def demo(tmp_path):
    home = tmp_path / "home"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1"}
    env.pop("HARU_NATS_URL", None)
    env.pop("HARU_API_TOKEN", None)
    proc, ready = launch_up(tmp_path, layout, env)
    tree: set[int] = set()
    try:
        info = wait_ready(ready)
        info["home"] = home
        info["env"] = env
        info["proc"] = proc
        info["tree"] = tree
        yield info
    finally:
        stop_and_reap(proc, tree, wait_s=60)
