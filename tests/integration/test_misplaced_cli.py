"""A forged event with intact chains: `haru verify` fails on it (exit 8, MISPLACED) and names it;
`haru why` and `as-of` leave it out and say so on stderr; `haru history` marks it. Real nats-server,
real CLI processes. The forgeries are appended with `EventLog.append` (valid chains and Msg-Ids),
as an agent's own credentials can: the only thing wrong is where they stand."""

from __future__ import annotations

import json
from datetime import timedelta

from haru.cli.common import ExitStatus
from haru.core import events as ev
from haru.core import subjects
from tests.support import haru
from tests.support.stories import T0, script_stories

FORGER = "agent:default/a@host-a"


async def forge(log) -> dict[str, int]:
    """On a's own subjects (what agent.default.a may publish): a route move and b's model lost."""
    seqs = {}
    agent = subjects.agent("default", "a")
    seqs["route"] = await log.append(
        agent, ev.RouteMoved(at=T0 + timedelta(seconds=5), active="b", by=FORGER), expect=0
    )
    model = subjects.model("default", "a", "stories")
    seqs["lost"] = await log.append(
        model,
        ev.ModelLost(at=T0 + timedelta(seconds=6), domain="b", model="stories", reason="gpu_detached", by=FORGER),
        expect=await log.last_seq_of(model),
    )
    return seqs


async def test_verify_fails_on_misplaced_events_and_names_them(nats_server, event_log):
    await script_stories(event_log)
    clean = haru("verify", nats_url=nats_server.url)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    seqs = await forge(event_log)

    out = haru("verify", nats_url=nats_server.url)
    assert out.returncode == ExitStatus.MISPLACED == 8, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        f"seq {seqs['route']} on haru.evt.default.a.agent: route_moved by {FORGER} is misplaced: "
        "route_moved belongs on haru.evt.<fleet>.route (written by promoter), not on haru.evt.<fleet>.<domain>.agent"
    )
    assert lines[1] == (
        f"seq {seqs['lost']} on haru.evt.default.a.model.stories: model_lost by {FORGER} is misplaced: "
        "its body says domain 'b', its subject says 'a'"
    )
    assert "verify FAILED — 2 misplaced event(s), not applied by any fold" in lines[-1]

    out = haru("verify", "--json", nats_url=nats_server.url)
    doc = json.loads(out.stdout)
    assert out.returncode == 8 and doc["ok"] is False and doc["breaks"] == []
    assert [(m["seq"], m["type"], m["by"]) for m in doc["misplaced"]] == [
        (seqs["route"], "route_moved", FORGER),
        (seqs["lost"], "model_lost", FORGER),
    ]


async def test_why_and_as_of_leave_misplaced_events_out_and_say_so(nats_server, event_log):
    stories = await script_stories(event_log)
    seqs = await forge(event_log)
    out = haru("why", "stories", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    assert f"seq {seqs['lost']:>5}" not in out.stdout and "lost" not in out.stdout
    assert f"seq {seqs['route']:>5}" not in out.stdout
    # `why` reads only the model's own subjects (and the causes they name): the forged route move on
    # a's agent subject is not among them (`haru verify` finds it); the one on the model's subject is.
    assert "1 misplaced event(s) in fleet default not applied" in out.stderr
    assert f"seq {seqs['lost']} on haru.evt.default.a.model.stories: model_lost by {FORGER}" in out.stderr

    out = haru("as-of", "stories", str(seqs["lost"]), "--json", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    states = json.loads(out.stdout)
    assert set(states) == {"a"} and states["a"]["state"] == "stopped" and states["a"]["seq"] == stories["unloaded"]
    assert "misplaced" in out.stderr


async def test_history_marks_misplaced_events(nats_server, event_log):
    await script_stories(event_log)
    seqs = await forge(event_log)
    out = haru("history", "haru.evt.default.a.>", nats_url=nats_server.url)
    assert out.returncode == 0
    marked = [line for line in out.stdout.splitlines() if "MISPLACED" in line]
    assert len(marked) == 2 and f"MISPLACED by {FORGER}, not applied" in marked[0]
    out = haru("history", "--json", nats_url=nats_server.url)
    rows = {r["seq"]: r for r in json.loads(out.stdout)}
    assert rows[seqs["route"]]["misplaced"].startswith("route_moved belongs on")
    assert all(r["misplaced"] is None for s, r in rows.items() if s not in seqs.values())
