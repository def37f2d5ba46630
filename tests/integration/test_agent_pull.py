"""A layout that names references: the agent pulls each into its store (`pulling`, bytes done of total),
then a real llama-server loads the materialized file; a reference the registry does not have is
`failed` in the registry's words, and nothing starts for it."""

from __future__ import annotations

import contextlib

import pytest

from haru.core import subjects
from haru.core.events import ModelFailed, ModelLoading, ModelPulling, ModelResident
from tests.support.llama import llama_binary, llama_model, real_fleet, real_layout
from tests.support.models_registry import Server, build_registry
from tests.support.wait import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.timeout(120)]


async def events_of(log, fleet: str, domain: str, model: str):
    return [r.event for r in await log.history(subjects.model(fleet, domain, model)) if r.event is not None]


async def test_the_agent_pulls_a_reference_then_serves_it(tmp_path, nats_server, event_log, monkeypatch):
    binary = llama_binary()
    reg = build_registry(tmp_path / "reg")
    async with Server(reg.root) as registry:
        home = tmp_path / "agent-home"
        for k, v in {"HF_ENDPOINT": registry.url, "HARU_OLLAMA_REGISTRY": registry.url, "HARU_HOME": str(home)}.items():
            monkeypatch.setenv(k, v)
        pulled = llama_model("tiny", binary, tmp_path / "unused.gguf")
        pulled["source"] = "hf:acme/tiny-GGUF:Q8_0"
        missing = llama_model("gone", binary, tmp_path / "unused.gguf")
        missing["source"] = "ollama:nothing-here:1b"
        layout = real_layout(tmp_path / "layout.json", tmp_path, {"solo": [pulled, missing]})
        async with real_fleet(tmp_path, nats_server, event_log, layout) as gw:

            async def resident():
                evs = await events_of(event_log, "default", "solo", "tiny")
                return evs if any(isinstance(e, ModelResident) for e in evs) else None

            evs = await wait_until(resident, 60.0, interval_s=0.2)
            kinds = [type(e).__name__ for e in evs]
            assert kinds[:1] == ["ModelPulling"] and "ModelLoading" in kinds, kinds
            pulls = [e for e in evs if isinstance(e, ModelPulling)]
            size = (reg.root / "files/q8.gguf").stat().st_size
            assert pulls[0].done_bytes == 0 and pulls[0].total_bytes == size
            assert pulls[-1].done_bytes == size and [f.name for f in pulls[-1].files] == ["tiny-Q8_0.gguf"]
            assert pulls[-1].files[0].digest.startswith("sha256:") and pulls[-1].origin == registry.url
            assert kinds.index("ModelLoading") > kinds.index("ModelPulling")
            assert (home / "models" / "blobs" / pulls[-1].files[0].digest.replace(":", "-")).exists()

            async def failed():
                evs = await events_of(event_log, "default", "solo", "gone")
                return [e for e in evs if isinstance(e, ModelFailed)]

            why = (await wait_until(failed, 60.0, interval_s=0.2))[0].runtime_said
            assert why.startswith("pull ollama:nothing-here:1b: Ollama model library/nothing-here:1b not found (404")
            evs = await events_of(event_log, "default", "solo", "gone")
            assert not any(isinstance(e, ModelLoading) for e in evs)  # nothing started for it
            # (resident means the real llama-server answered a completion on the pulled file; the first
            # route waits for every model of the domain, so chat through the gateway is test_serve's)
            del gw


async def test_an_agent_stopped_mid_pull_records_stopped_and_keeps_the_partial(
    tmp_path, nats_server, event_log, monkeypatch
):
    import signal

    binary = llama_binary()
    reg = build_registry(tmp_path / "reg")
    async with Server(reg.root, rate=60_000) as registry:  # ~600 KB at 60 KB/s: ~10 s, time to stop it
        home = tmp_path / "agent-home"
        for k, v in {"HF_ENDPOINT": registry.url, "HARU_OLLAMA_REGISTRY": registry.url, "HARU_HOME": str(home)}.items():
            monkeypatch.setenv(k, v)
        model = llama_model("tiny", binary, tmp_path / "unused.gguf")
        model["source"] = "ollama:tiny:1b"
        layout = real_layout(tmp_path / "layout.json", tmp_path, {"solo": [model]})
        async with real_fleet(tmp_path, nats_server, event_log, layout) as gw:

            async def started():
                evs = await events_of(event_log, "default", "solo", "tiny")
                return [e for e in evs if isinstance(e, ModelPulling)]

            await wait_until(started, 60.0, interval_s=0.2)
            parts = home / "models" / "partial"

            def part_sizes() -> list[int]:
                sizes = []
                for p in parts.glob("*.part") if parts.exists() else ():
                    with contextlib.suppress(FileNotFoundError):  # committed (renamed) since the glob
                        sizes.append(p.stat().st_size)
                return sizes

            async def some_bytes():
                # More than the manifest's config and template (under 1 KiB each, pulled and renamed in
                # a moment; a poll that caught one of those mid-fsync sent the SIGTERM before the GGUF's
                # .part had a byte): the weights' .part has begun.
                return any(size > 4096 for size in part_sizes())

            await wait_until(some_bytes, 30, interval_s=0.2)
            agent = gw.agents[0]
            agent.signal(signal.SIGINT)  # stopping for good: the pull is interrupted and said so
            assert await agent.wait(30) == 0
            evs = await events_of(event_log, "default", "solo", "tiny")
            last = evs[-1]
            assert type(last).__name__ == "ModelStopped" and "during the pull" in last.detail, evs
            assert not any(isinstance(e, ModelLoading) for e in evs)
            assert any(size > 4096 for size in part_sizes())  # kept, to resume
            assert not list((home / "models" / "snapshots").iterdir())
