"""The tokens the gateway served are recorded in the log: `tokens_counted` deltas on haru.evt.<fleet>.usage,
streamed responses and whole ones alike, adding up to what the clients were told; the last deltas are
written when the gateway stops; an unknown fleet writes nothing."""

from __future__ import annotations

import pytest

from haru.core import subjects
from haru.core.events import TokensCounted
from tests.support.gateway import MODEL, TwoDomains, running_gateway, sdk
from tests.support.sim_vllm import SimServer
from tests.support.wait import wait_until

CHAT = [{"role": "user", "content": "How much does a standby cost?"}]


async def _recorded(event_log) -> tuple[int, int, int, list[TokensCounted]]:
    events = [r.event for r in await event_log.history(subjects.usage("default"))]
    counted = [e for e in events if isinstance(e, TokensCounted)]
    prompt = sum(m.prompt for e in counted for m in e.models if m.model == MODEL)
    completion = sum(m.completion for e in counted for m in e.models if m.model == MODEL)
    responses = sum(m.responses for e in counted for m in e.models if m.model == MODEL)
    return prompt, completion, responses, counted


@pytest.mark.timeout(60)
async def test_the_tokens_served_are_recorded_as_deltas_in_the_log(event_log, tmp_path):
    sim = await SimServer(tmp_path / "sim", model=MODEL).start()
    try:
        async with running_gateway(event_log, usage_flush_ms=100) as gw:
            two = TwoDomains(event_log, gw, sim, sim)
            await two.route_to_a(runtime="vllm")
            async with sdk(gw) as client:
                whole = await client.chat.completions.create(model=MODEL, messages=CHAT)
                stream = await client.chat.completions.create(
                    model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
            assert whole.usage is not None and chunks[-1].usage is not None
            want = (
                whole.usage.prompt_tokens + chunks[-1].usage.prompt_tokens,
                whole.usage.completion_tokens + chunks[-1].usage.completion_tokens,
                2,
            )

            async def recorded():
                got = await _recorded(event_log)
                return got if got[:3] == want else None

            prompt, completion, responses, counted = await wait_until(recorded, 20, what="the tokens in the log")
            assert all(e.gateway == gw.gateway_id() and e.fleet == "default" for e in counted)
            # one more after the flushes so far, written when the gateway stops
            async with sdk(gw) as client:
                last = await client.chat.completions.create(model=MODEL, messages=CHAT)
            before_stop = len(counted)
        prompt, completion, responses, counted = await _recorded(event_log)
    finally:
        await sim.stop()
    assert last.usage is not None
    assert (prompt, completion, responses) == (
        want[0] + last.usage.prompt_tokens,
        want[1] + last.usage.completion_tokens,
        3,
    )
    assert len(counted) > before_stop
    # deltas: each names where the previous one ended
    assert all(b.since == a.at for a, b in zip(counted, counted[1:], strict=False))
