"""The agent's environment is read once, by `haru agent`, and handed down as values: the parts the agent
wires read none of it, and a bad value is refused at start with the variable named."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from haru.agents.serving_env import DEFAULT_MAX_BODY, ServingEnv
from haru.core.errors import ConfigError
from tests.support import haru
from tests.support.source import reads_environment

pytestmark = pytest.mark.timeout(60)

AGENTS = Path(__file__).resolve().parents[2] / "agents"

# What may still read the environment, and why: each is a process of its own or reads for one.
READERS = {
    "config.py": "the agent config's helpers, called by `haru agent` (HARU_AGENT_CONFIG, XDG_STATE_HOME)",
    "training.py": "a trainer inherits the agent's environment, plus its two variables",
    "portholder.py": "starts the holder with the agent's environment; the holder, a process of its own, reads it "
    "once in its main()",
}


def test_the_agents_parts_read_no_environment():
    found = {
        path.name: lines
        for path in sorted(AGENTS.glob("*.py"))
        if path.name not in READERS and (lines := reads_environment(ast.parse(path.read_text())))
    }
    assert found == {}, f"read the environment in haru/cli/agent.py and pass the value down: {found}"


def test_the_serving_port_takes_its_environment_as_values():
    env = ServingEnv.from_env({"HARU_SERVING_TOKEN": "s3cret", "HARU_SERVING_MAX_BODY_BYTES": "1000"})
    assert (env.token, env.max_body) == ("s3cret", 1000)
    assert ServingEnv.from_env({}) == ServingEnv() and ServingEnv().max_body == DEFAULT_MAX_BODY
    with pytest.raises(ConfigError, match="HARU_SERVING_MAX_BODY_BYTES"):
        ServingEnv.from_env({"HARU_SERVING_MAX_BODY_BYTES": "lots"})


def test_haru_agent_refuses_a_body_limit_that_is_not_a_number_and_names_it(tmp_path):
    # refused before any connection is tried: the URL below has no server
    config = json.dumps(
        {"fleet": "default", "domain": "a", "nats_url": "nats://127.0.0.1:9", "state_dir": str(tmp_path)}
    )
    out = haru("agent", "--config", config, env={"HARU_SERVING_MAX_BODY_BYTES": "lots"})
    assert out.returncode != 0
    assert "HARU_SERVING_MAX_BODY_BYTES" in out.stderr and "lots" in out.stderr
    assert "Traceback" not in out.stderr  # one line naming the variable, not a crash at import
