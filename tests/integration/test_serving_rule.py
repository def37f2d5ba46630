"""The agent's serving port follows the gateway's rule (issue 29): loopback unless HARU_SERVING_TOKEN is
set, otherwise refused before the agent claims its domain or touches a runtime, with the fix named; and
`serve: direct` (vLLM's development-mode endpoints on the network) only where the layout says the
network is private and that is acceptable there."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from haru.agents.serving import bind_refusal, check_serving
from haru.core import subjects
from haru.core.errors import ConfigError, LayoutError
from haru.core.layout import parse_layout

LAYOUT = "deploy/examples/demo-fleet.json"


def test_the_rule_is_loopback_unless_a_token_is_set():
    for host in ("127.0.0.1", "localhost", "::1"):
        assert bind_refusal(host, "") == ""
    assert bind_refusal("0.0.0.0", "s3cret") == ""
    refusal = bind_refusal("0.0.0.0", "")
    assert "without HARU_SERVING_TOKEN" in refusal and "set HARU_SERVING_TOKEN" in refusal
    assert '"serving": {"host": "127.0.0.1"}' in refusal
    assert "every address" in bind_refusal("", "")


def test_a_direct_domain_opens_no_serving_port_so_the_rule_does_not_apply_to_it(monkeypatch):
    monkeypatch.delenv("HARU_SERVING_TOKEN", raising=False)
    config = SimpleNamespace(serving=SimpleNamespace(enabled=True, host="0.0.0.0"))
    slots = lambda serve: SimpleNamespace(domain=SimpleNamespace(spec=SimpleNamespace(serve=serve)))  # noqa: E731
    with pytest.raises(ConfigError, match="HARU_SERVING_TOKEN"):
        check_serving(config, slots("agent"), "")
    check_serving(config, slots("direct"), "")
    check_serving(config, slots("agent"), "s3cret")


def _direct(**extra) -> bytes:
    domain = {
        "name": "a",
        "serve": "direct",
        "gpus": [{"index": 0, "memory": "24GiB"}],
        "slots": [
            {"name": "chat", "gpu": 0, "models": [{"name": "m", "source": "/srv/m", "vram": "4GiB", "port": 8001}]}
        ],
        **extra,
    }
    return json.dumps({"fleet": "f", "domains": [domain]}).encode()


def test_serve_direct_is_refused_unless_the_layout_says_the_network_is_private_and_that_is_acceptable():
    for extra in ({}, {"network": "private"}, {"expose_dev_endpoints": True}):
        with pytest.raises(LayoutError) as caught:
            parse_layout(_direct(**extra))
        text = str(caught.value)
        assert "$.domains[0].serve" in text and "/sleep" in text and '"network": "private"' in text, text
    layout = parse_layout(_direct(network="private", expose_dev_endpoints=True))
    assert layout.domains[0].spec.serve == "direct"


async def test_an_agent_that_would_listen_on_every_address_without_a_token_is_refused_before_it_claims(
    nats_server, event_log, tmp_path, monkeypatch
):
    from haru.core.layout import load_layout
    from haru.log.apply import apply

    monkeypatch.delenv("HARU_SERVING_TOKEN", raising=False)
    await apply(event_log, load_layout(LAYOUT), datetime.now(UTC))
    config = json.dumps(
        {
            "fleet": "default",
            "domain": "a",
            "nats_url": nats_server.url,
            "gpus": "sim",
            "sim_dir": str(tmp_path / "sim"),
            "state_dir": str(tmp_path / "state"),
            "serving": {"host": "0.0.0.0", "port": 0},
        }
    )
    from tests.support import haru

    env = {k: v for k, v in os.environ.items() if k != "HARU_SERVING_TOKEN"}
    out = await asyncio.to_thread(haru, "agent", "--config", config, "--log-format", "json", env=env)
    assert out.returncode == 1 and "without HARU_SERVING_TOKEN" in out.stderr, out.stderr
    # Refused before anything: the domain was never claimed.
    assert await event_log.history(subjects.agent(("default"), "a")) == []
