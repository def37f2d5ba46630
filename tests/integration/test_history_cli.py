"""`haru why`, `haru as-of` and `haru history` on a scripted history: hearth's `stories` example."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.support import haru
from tests.support.stories import script_stories


async def test_why_draws_the_causal_tree_and_says_where_a_link_is_missing(nats_server, event_log):
    seqs = await script_stories(event_log)
    out = haru("why", "stories", nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    missing = "     ! no cause recorded, though this kind of event has one: a link is missing"
    assert lines == [
        f"● seq {seqs['unloaded']:>7}  unloaded       a        {{}}",
        missing,
        f'● seq {seqs["loading"]:>7}  loading        a        {{"endpoint":"127.0.0.1:18080","pid":10121,"attempt":1}}',
        missing,
        f"  └─ seq {seqs['resident']:>7}  resident       a        "
        '{"endpoint":"127.0.0.1:18080","warmup_ms":256,"sleeps":true}',
        f"● seq {seqs['model_declared']:>7}  declared       a        "
        '{"runtime":"llama_server","gpu_index":0,"vram_bytes":1073741824}',
        f'  └─ seq {seqs["declared"]:>7}  admitted       a        {{"admitted":true,"vram_bytes":1073741824}}',
    ]
    out = haru("why", "stories", "--json", nats_url=nats_server.url)
    import json

    tree = json.loads(out.stdout)
    assert [n["seq"] for n in tree] == [seqs["unloaded"], seqs["loading"], seqs["model_declared"]]
    assert tree[1]["missing_link"] and tree[1]["caused"][0]["seq"] == seqs["resident"]
    assert tree[1]["caused"][0]["cause"] == seqs["loading"] and tree[1]["caused"][0]["missing_link"] is None
    assert tree[2]["missing_link"] is None and tree[2]["caused"][0]["type"] == "admission_decided"


async def test_as_of_a_sequence_and_a_time(nats_server, event_log):
    seqs = await script_stories(event_log)
    out = haru("as-of", "stories", str(seqs["resident"]), nats_url=nats_server.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"as of seq {seqs['resident']}: stories was `resident` "
        '{"endpoint":"127.0.0.1:18080","warmup_ms":256,"sleeps":true}'
    )
    out = haru("as-of", "stories", str(seqs["loading"]), nats_url=nats_server.url)
    assert "was `loading`" in out.stdout
    out = haru("as-of", "stories", str(seqs["declared"]), nats_url=nats_server.url)
    assert "was `unknown`" in out.stdout
    # a time after everything was recorded
    later = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    out = haru("as-of", "stories", later, nats_url=nats_server.url)
    assert "was `stopped`" in out.stdout
    bad = haru("as-of", "stories", "yesterday-ish", nats_url=nats_server.url)
    assert bad.returncode == 2 and "neither a stream sequence nor an ISO-8601 time" in bad.stderr


async def test_why_for_an_unknown_model_says_so(nats_server, event_log):
    await script_stories(event_log)
    out = haru("why", "Stories", nats_url=nats_server.url)
    assert out.returncode == 3
    assert "matched exactly" in out.stderr


async def test_history_prints_raw_events(nats_server, event_log):
    seqs = await script_stories(event_log)
    out = haru("history", "haru.evt.default.a.>", nats_url=nats_server.url)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    assert "model_loading" in lines[0] and "haru.evt.default.a.model.stories" in lines[0]
    out = haru("history", "--limit", "1", "--json", nats_url=nats_server.url)
    import json

    (only,) = json.loads(out.stdout)
    assert only["seq"] == seqs["unloaded"] and only["type"] == "model_stopped"


async def test_commands_without_a_server_explain_the_fix():
    out = haru("verify", nats_url="nats://127.0.0.1:1")
    assert out.returncode != 0
    assert "cannot reach NATS" in out.stderr and "--nats-url" in out.stderr
    assert "Traceback" not in out.stderr
