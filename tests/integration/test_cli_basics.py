"""What a newcomer trips on: `haru --version`, `haru up --demo --fresh` (the previous demo's state moved
aside, never deleted; refused while a `haru up` runs on that home)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from haru.core.errors import ConfigError
from haru.up.home import HomeLock, fresh_start
from tests.support import haru


def test_version():
    proc = haru("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("haru ") and proc.stdout.strip() != "haru"


def test_a_bad_count_in_the_environment_is_one_line_for_the_command_that_reads_it():
    env = {"HARU_REPLICAS": "three", "HARU_CHECKPOINT_EVERY": "0"}
    assert haru("--version", env=env).returncode == 0  # every other command is unaffected
    proc = haru("projector", "--nats-url", "nats://127.0.0.1:1", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'three' (from $HARU_REPLICAS) is not a whole number of 1 or more" in proc.stderr
    proc = haru("projector", "--replicas", "3", "--nats-url", "nats://127.0.0.1:1", env=env)
    assert "'0' (from $HARU_CHECKPOINT_EVERY) is not a whole number of 1 or more" in proc.stderr


def test_fresh_moves_the_previous_demo_aside(tmp_path):
    home = tmp_path / "home"
    for part in ("nats/jetstream", "sim/a", "demo/agents"):
        (home / part).mkdir(parents=True)
    (home / "nats" / "jetstream" / "data").write_text("history")
    (home / "models").mkdir()  # pulled models are not demo state: they stay
    moved = fresh_start(home, datetime(2026, 11, 30, 22, 0, tzinfo=UTC))
    assert moved == home / "previous" / "20261130T220000Z"
    assert (moved / "nats" / "jetstream" / "data").read_text() == "history"
    assert not (home / "nats").exists() and not (home / "sim").exists() and (home / "models").exists()
    assert fresh_start(home) is None  # nothing left to move


def test_fresh_is_refused_while_an_up_runs_on_that_home(tmp_path):
    home = tmp_path / "home"
    (home / "nats").mkdir(parents=True)
    running = HomeLock(home)  # the lock a live `haru up` holds on its home
    running.acquire()
    try:
        with pytest.raises(ConfigError, match="haru up is already running on"):
            fresh_start(home)
        proc = haru("up", "--demo", "--fresh", "--home", str(home), "--nats-port", "0")
    finally:
        running.release()
    assert proc.returncode == 4 and "haru up is already running on" in proc.stderr
    assert (home / "nats").exists()  # nothing was moved away from under it
    moved = fresh_start(home)  # once it is gone, the state moves aside (never deleted)
    assert moved is not None and (moved / "nats").is_dir() and not (home / "nats").exists()
    alone = haru("up", "--fresh", "--home", str(home))
    assert alone.returncode == 1 and "--fresh goes with --demo" in alone.stderr


def test_up_model_is_serve_and_goes_alone(tmp_path):
    proc = haru("up", "--demo", "--model", "x=/m.gguf:1", "--home", str(tmp_path))
    assert proc.returncode == 1 and "--model runs a fleet of its own" in proc.stderr
    bad = haru("up", "--model", "x=./missing.gguf:1", "--gpu-memory", "8", "--home", str(tmp_path))
    assert bad.returncode == 2 and "missing.gguf does not exist" in bad.stderr  # the serve path, via up
