"""Every command exits as docs/cli.md's table says, for each failure class it can meet (issue 29).

Each class is run for each command that can meet it, in process (`haru.cli.main`, the entry point the
`haru` script calls), so the table is checked in seconds: usage (2: an unknown flag, a path that does
not exist), not found (3: a fleet, model, domain or operation that is not there, on a real
nats-server), unavailable (6: a refused NATS, gateway or registry). The dry run's exit 0 without NATS
is here too: validating a layout needs no control plane.
"""

from __future__ import annotations

import json
from datetime import UTC

import pytest

from haru.cli import main
from haru.cli.common import ExitStatus
from tests.support.ports import lasting_port

REFUSED = f"nats://127.0.0.1:{lasting_port()}"  # nothing listens there
LAYOUT = "deploy/examples/demo-fleet.json"

# Every command, with the arguments that make it otherwise valid.
COMMANDS: dict[str, list[str]] = {
    "up": ["up"],
    "serve": ["serve", "--model", "x=/m.gguf:1"],
    "resolve": ["resolve", "qwen3:0.6b"],
    "pull": ["pull", "qwen3:0.6b"],
    "convert": ["convert", "/m"],
    "runtime": ["runtime", "llama", "--check"],
    "apply": ["apply", "-f", LAYOUT],
    "status": ["status"],
    "route": ["route"],
    "why": ["why", "m"],
    "as-of": ["as-of", "m", "1"],
    "history": ["history"],
    "verify": ["verify"],
    "cost": ["cost"],
    "promote": ["promote", "b"],
    "demote": ["demote", "b"],
    "roll": ["roll"],
    "op": ["op"],
    "provision": ["provision", "a"],
    "teardown": ["teardown", "a"],
    "replace": ["replace", "a"],
    "agent": ["agent", "--config", "x.json"],
    "projector": ["projector"],
    "promoter": ["promoter"],
    "gateway": ["gateway"],
    "sink": ["sink", "postgres", "--dsn", "postgresql://x"],
    "run": ["run", "m"],
    "sim": ["sim", "status"],
}

# The commands that read NATS, as their users run them.
NATS_COMMANDS = [
    "apply",
    "status",
    "route",
    "why",
    "as-of",
    "history",
    "verify",
    "cost",
    "promote",
    "demote",
    "roll",
    "op",
    "provision",
    "teardown",
    "replace",
    "projector",
    "promoter",
    "gateway",
]


@pytest.fixture(autouse=True)
def _no_global_logging_config(monkeypatch):
    """The services configure structlog globally, caching loggers bound to the stderr of the moment: in
    process, that is capsys's, closed after the test, and every later test in this worker would log into
    it. Here structlog keeps its (uncached) defaults."""
    import structlog

    monkeypatch.setattr(structlog, "configure", lambda **kwargs: None)


def cli(capsys, *argv: str, env: dict[str, str] | None = None, monkeypatch=None) -> tuple[int, str, str]:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_table_covers_every_command():
    from haru.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_an_unknown_flag_is_usage(capsys, name):
    rc, _, err = cli(capsys, *COMMANDS[name], "--no-such-flag")
    assert rc == ExitStatus.USAGE, (name, err)
    assert "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["apply", "-f", "/no/such/layout.json", "--nats-url", REFUSED], "no such file"),
        (["apply", "-f", "/no/such/layout.json", "--dry-run"], "no such file"),
        (["agent", "--config", "/no/such/agent.json"], "/no/such/agent.json"),
        (["convert", "/no/such/model"], "/no/such/model does not exist"),
        (["serve", "--model", "x=/no/such.gguf:1", "--gpu-memory", "8"], "/no/such.gguf does not exist"),
    ],
)
def test_a_path_that_does_not_exist_is_usage(capsys, argv, says):
    rc, _, err = cli(capsys, *argv)
    assert rc == ExitStatus.USAGE, (argv, err)
    assert says in err


@pytest.mark.parametrize("name", NATS_COMMANDS)
def test_a_refused_nats_is_unavailable(capsys, name):
    rc, _, err = cli(capsys, *COMMANDS[name], "--nats-url", REFUSED)
    assert rc == ExitStatus.UNAVAILABLE, (name, err)
    assert REFUSED in err and "connection refused" in err


def test_up_and_route_watch_refused_by_nats_are_unavailable(capsys, tmp_path):
    rc, _, err = cli(capsys, "up", "--nats-url", REFUSED, "--home", str(tmp_path / "home"), "--port", "0")
    assert rc == ExitStatus.UNAVAILABLE and REFUSED in err, err
    rc, _, err = cli(capsys, "route", "--watch", "--nats-url", REFUSED)
    assert rc == ExitStatus.UNAVAILABLE and REFUSED in err, err


def test_a_simulated_domain_that_is_not_there_is_not_found(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HARU_HOME", str(tmp_path))
    rc, _, err = cli(capsys, "sim", "detach-gpu", "zz")
    assert rc == ExitStatus.NOT_FOUND and "'zz'" in err, err


def test_a_refused_gateway_or_registry_is_unavailable(capsys, monkeypatch, tmp_path):
    dead = f"http://127.0.0.1:{lasting_port()}"
    rc, _, err = cli(capsys, "run", "m", "--url", dead)
    assert rc == ExitStatus.UNAVAILABLE and dead in err
    monkeypatch.setenv("HARU_OLLAMA_REGISTRY", dead)
    for argv in (["resolve", "qwen3:0.6b"], ["pull", "qwen3:0.6b", "--home", str(tmp_path)]):
        rc, _, err = cli(capsys, *argv)
        assert rc == ExitStatus.UNAVAILABLE and "cannot reach the registry" in err, (argv, err)


def test_a_dry_run_without_nats_validates_and_exits_0_saying_what_it_did_not_read(capsys):
    rc, out, err = cli(capsys, "apply", "-f", LAYOUT, "--dry-run", "--nats-url", REFUSED)
    assert rc == ExitStatus.OK, err
    assert "domain a gpu 0:" in out and "dry run without the running state" in out and REFUSED in out
    rc, out, _ = cli(capsys, "apply", "-f", LAYOUT, "--dry-run", "--json", "--nats-url", REFUSED)
    doc = json.loads(out)
    assert rc == ExitStatus.OK and doc["running_state_read"] is False and doc["admitted"]
    # An invalid layout is still refused without NATS: the dry run validated it.
    bad = "/tmp/haru-truth-bad-layout.json"
    with open(bad, "w") as f:
        json.dump({"fleet": "Bad Name", "domains": []}, f)
    rc, _, err = cli(capsys, "apply", "-f", bad, "--dry-run", "--nats-url", REFUSED)
    assert rc == ExitStatus.ERROR and "fleet" in err


async def test_what_is_not_there_is_not_found(nats_server, event_log, capsys):
    import asyncio
    from datetime import datetime

    from haru.core.layout import load_layout
    from haru.log.apply import apply

    await apply(event_log, load_layout(LAYOUT), datetime.now(UTC))
    url = nats_server.url
    cases = [
        ["status", "--fleet", "nope"],
        ["route", "--fleet", "nope"],
        ["why", "no-such-model"],
        ["as-of", "no-such-model", "1"],
        ["promote", "zz"],
        ["demote", "zz"],
        ["op", "op-nope"],
        ["provision", "zz"],
        ["teardown", "zz"],
        ["replace", "zz"],
    ]
    for argv in cases:
        rc, _, err = await asyncio.to_thread(cli, capsys, *argv, "--nats-url", url)
        assert rc == ExitStatus.NOT_FOUND, (argv, rc, err)
    rc, _, err = await asyncio.to_thread(
        cli, capsys, "status", "--fleet", "00000000-0000-4000-8000-000000000000", "--nats-url", url
    )
    assert rc == ExitStatus.NOT_FOUND and "no fleet has UUID" in err


async def test_every_fleet_option_takes_the_fleets_uuid(nats_server, event_log, capsys):
    """Haru's API took "slug or UUID" for a fleet: so does `--fleet`, resolved through the stored views."""
    import asyncio
    from datetime import datetime

    from haru.core.fold import fold
    from haru.core.layout import load_layout
    from haru.core.specs import fleet_uuid
    from haru.core.views import view_encoder
    from haru.log.apply import apply

    await apply(event_log, load_layout(LAYOUT), datetime.now(UTC))
    records = await event_log.history("haru.evt.default.>")
    view = fold((r.seq, r.subject, r.event) for r in records)["default"]
    assert view.uuid == fleet_uuid("default")  # recorded with the declaration, folded into the view
    await event_log.put_view("fleet.default", view_encoder.encode(view), last=0)
    rc, out, err = await asyncio.to_thread(
        cli, capsys, "status", "--fleet", fleet_uuid("default"), "--nats-url", nats_server.url
    )
    assert rc == ExitStatus.OK and out.startswith("fleet default"), err


def test_an_agent_refused_by_nats_is_unavailable_and_takes_its_config_inline(capsys, tmp_path):
    config = json.dumps({"fleet": "f", "domain": "a", "nats_url": REFUSED, "gpus": "sim", "sim_dir": str(tmp_path)})
    rc, _, err = cli(capsys, "agent", "--config", config, "--log-format", "json")
    assert rc == ExitStatus.UNAVAILABLE and REFUSED in err, err


def test_an_agent_without_a_config_is_usage(capsys, monkeypatch):
    monkeypatch.delenv("HARU_AGENT_CONFIG", raising=False)
    monkeypatch.delenv("HARU_SUPERVISOR_CONFIG", raising=False)
    rc, _, err = cli(capsys, "agent")
    assert rc == ExitStatus.USAGE and "HARU_AGENT_CONFIG" in err
