"""`haru gateway` and `haru run` as real processes, in front of the simulated vLLM server
(`python -m haru.agents.sim.vllm serve`, a real process that names its domain in every answer)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import openai
import pytest

from haru.core.residency import Answer
from tests.support.gateway_cli import MODEL, haru_gateway, publish, run_repl, sim_vllm


async def until_ok(client: openai.AsyncOpenAI) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            page = await client.models.list()
            if page.data and page.data[0].model_extra["haru"]["routable"]:
                return
        except openai.APIError:
            pass
        assert time.monotonic() < deadline, "the gateway never routed the model"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_haru_gateway_and_haru_run_against_the_simulator(event_log, nats_server, tmp_path):
    # 10 tokens a second: the 9-token answer takes ~0.9 s to generate, so a stream read in bursts because
    # this process was descheduled for a moment (two test workers share two cores) is still told apart
    # from one the gateway buffered whole (every chunk at once)
    async with (
        sim_vllm(tmp_path / "sim", "a", tokens_per_s=10) as sim_url,
        haru_gateway(nats_server.url, tmp_path, HARU_API_TOKEN="tok", HARU_DEFAULT_FLEET="cli") as (
            gw_url,
            proc,
            log_path,
        ),
    ):
        view_rev, intent_seq = await publish(event_log, "cli", sim_url, Answer(answer="ready"))
        async with openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key="tok", max_retries=0) as client:
            await until_ok(client)
            # chat and streaming chat through the real process, the simulator answering
            reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content.startswith("[domain a] hello from qwen3.6:27b")
            arrivals, texts = [], []
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for chunk in stream:
                arrivals.append(time.monotonic())
                if chunk.choices:
                    texts.append(chunk.choices[0].delta.content or "")
            assert "".join(texts) == "[domain a] hello from qwen3.6:27b on the simulated GPU."
            assert arrivals[-1] - arrivals[0] >= 0.3, arrivals  # 9 tokens at 10/s: spread out, not buffered

        # the REPL: streamed answers, /clear, /exit
        code, out, err = await run_repl(
            gw_url, "hello\n/clear\nagain\n/exit\nnever sent\n", env={"HARU_API_TOKEN": "tok"}
        )
        assert code == 0, err
        assert out.count("[domain a] hello from qwen3.6:27b on the simulated GPU.") == 2
        assert "(conversation cleared)" in err

        # a refusal shows the gateway's own message; the REPL goes on
        await publish(
            event_log,
            "cli",
            sim_url,
            Answer(answer="not_admitted", short_by_bytes=3 * 2**30),
            view_rev=view_rev,
            intent_seq=intent_seq,
            revision=2,
        )
        deadline = time.monotonic() + 10
        while True:
            code, out, err = await run_repl(gw_url, "hello\n", env={"HARU_API_TOKEN": "tok"})
            if "model_not_admitted" in err or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert code == 1
        assert "short by 3.0 GiB" in err and "(model_not_admitted, HTTP 409)" in err

        # without the token
        code, out, err = await run_repl(gw_url, "hello\n", env={"HARU_API_TOKEN": ""})
        assert code == 1 and "invalid_api_key" in err

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    logged = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert any(e["event"] == "gateway.listening" and e["auth"] is True for e in logged)


async def test_haru_gateway_without_token_warns_and_binds_loopback(nats_server, tmp_path):
    async with haru_gateway(nats_server.url, tmp_path, HARU_API_TOKEN="", HARU_GATEWAY_HOST="0.0.0.0") as (
        url,
        proc,
        log,
    ):
        assert url.startswith("http://127.0.0.1:")
        text = log.read_text()
        assert "gateway.UNAUTHENTICATED" in text and "asked for '0.0.0.0'" in text
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_haru_run_says_when_the_gateway_is_not_there():
    code, out, err = await run_repl("http://127.0.0.1:9", "hello\n")
    assert code == 6 and "cannot reach the gateway at http://127.0.0.1:9" in err
