"""The simulated vLLM server, as a real process on a real socket, behaves like vLLM where the agent looks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from haru.agents.sim.gpu_state import GiB, MiB, SimGpuState
from haru.agents.sim.vllm import runtime_path
from tests.support.sim_vllm import MODEL, SimServer


@pytest.fixture
async def servers(tmp_path):
    started: list[SimServer] = []

    async def start(sim_dir: Path | None = None, wait_ready: bool = True, **kw) -> SimServer:
        server = SimServer(sim_dir or tmp_path / "a", **kw)
        started.append(server)
        return await server.start(wait_ready=wait_ready)

    try:
        yield start
    finally:
        for server in started:
            await server.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def chat_body(model: str = MODEL, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "say hello"}], **extra}


async def test_loading_refuses_connections_then_serves_like_vllm(servers, http, tmp_path):
    server = await servers(wait_ready=False, HARU_SIM_LOAD_MS="600")
    assert server.port, server.stderr
    # While loading the port is bound but nobody listens: vLLM starts its HTTP server after the engine.
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(server.url + "/health"):
            pass
    gpu = SimGpuState(tmp_path / "a", 0).read()
    assert gpu["allocations"] == {str(server.proc.pid): 4 * GiB}  # the weights are on the GPU while loading
    await server.wait_ready()
    async with http.get(server.url + "/health") as r:
        assert r.status == 200


async def test_chat_json_names_the_domain_and_honours_max_tokens(servers, http):
    server = await servers(domain="b")
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=3)) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["choices"][0]["message"]["content"] == "[domain b] hello from"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3

    async with http.post(server.url + "/v1/chat/completions", json=chat_body()) as r:
        body = await r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"].startswith("[domain b] ")
    assert MODEL in body["choices"][0]["message"]["content"]

    async with http.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}) as r:
        body = await r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "[domain b]"

    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=20, ignore_eos=True)) as r:
        body = await r.json()
    assert body["usage"]["completion_tokens"] == 20


async def test_models_lists_the_served_name_and_unknown_models_are_404(servers, http):
    server = await servers()
    async with http.get(server.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(model="other")) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["type"] == "NotFoundError" and "other" in err["message"] and err["code"] == 404
    async with http.post(server.url + "/v1/chat/completions", data=b"not json") as r:
        assert r.status == 400
        assert "error" in await r.json()


async def test_chat_sse_streams_chunks_over_time_and_ends_with_done(servers, http):
    server = await servers(HARU_SIM_TOKENS_PER_S="20")
    arrivals: list[tuple[float, bytes]] = []
    body = chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with http.post(server.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.strip():
                arrivals.append((time.monotonic(), line.strip()))
    assert arrivals[-1][1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: ") :]) for _, line in arrivals[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "[domain a] hello from qwen3.6:27b on the"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    content_times = [t for t, line in arrivals if b'"content":"' in line and b'"content":""' not in line]
    assert len(content_times) == 6
    # Six tokens at 20 tokens/s: the chunks arrive spread over time, not in one burst (5 gaps of 50 ms).
    assert content_times[-1] - content_times[0] >= 0.2


async def test_completions_sse(servers, http):
    server = await servers()
    async with http.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    ) as r:
        lines = [line.strip() async for line in r.content if line.strip()]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["[domain a]", " hello"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_embeddings_are_deterministic(servers, http):
    server = await servers()
    vectors = []
    for _ in range(2):
        async with http.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]}) as r:
            data = (await r.json())["data"]
        vectors.append([d["embedding"] for d in data])
    assert vectors[0] == vectors[1]
    assert vectors[0][0] != vectors[0][1]
    assert abs(sum(x * x for x in vectors[0][0]) - 1.0) < 1e-3


async def test_sleep_wake_round_trip_accounts_vram(servers, http, tmp_path):
    server = await servers(HARU_SIM_RESIDUAL="256MiB")
    gpu = SimGpuState(tmp_path / "a", 0)
    pid = str(server.proc.pid)
    async with http.get(server.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    async with http.post(server.url + "/sleep?level=1") as r:
        assert r.status == 200
    async with http.get(server.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    assert gpu.read()["allocations"] == {pid: 256 * MiB}
    async with http.get(server.url + "/health") as r:
        assert r.status == 200  # vLLM: health says the engine is alive, not that it is awake
    async with http.post(server.url + "/v1/chat/completions", json=chat_body()) as r:
        assert r.status == 503
        assert "sleeping" in (await r.json())["error"]["message"]
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 200
    async with http.get(server.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    assert gpu.read()["allocations"] == {pid: 4 * GiB}
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
        assert r.status == 200
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 200  # waking an awake server is a success


async def test_dev_endpoints_are_404_without_dev_mode(servers, http):
    server = await servers(dev_mode=False)
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        async with http.request(method, server.url + path) as r:
            assert r.status == 404, path


async def test_wake_fails_with_cuda_oom_when_the_gpu_is_full_and_stays_asleep(servers, http, tmp_path):
    gpu = SimGpuState(tmp_path / "a", 0)
    gpu.ensure(8 * GiB)
    server = await servers()
    async with http.post(server.url + "/sleep?level=1") as r:
        assert r.status == 200
    # Something else (a trainer) takes the VRAM the sleeping server freed.
    assert gpu.allocate(os.getpid(), 7 * GiB)
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 500
        assert "CUDA Error: out of memory" in (await r.json())["error"]["message"]
    async with http.get(server.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    gpu.free(os.getpid())
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 200
    async with http.get(server.url + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}


async def test_injected_oom_on_wake_fails_the_next_wake_only(servers, http):
    server = await servers()
    async with http.post(server.url + "/_sim/oom_on_wake") as r:
        assert r.status == 200
    await http.post(server.url + "/sleep?level=1")
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 500 and "CUDA Error: out of memory" in await r.text()
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 200


async def test_evict_drops_the_model_but_the_process_lives(servers, http, tmp_path):
    server = await servers()
    async with http.post(server.url + "/_sim/evict") as r:
        assert r.status == 200
    async with http.get(server.url + "/v1/models") as r:
        assert (await r.json())["data"] == []
    async with http.post(server.url + "/v1/chat/completions", json=chat_body()) as r:
        assert r.status == 404
    async with http.get(server.url + "/health") as r:
        assert r.status == 200
    assert server.proc.returncode is None
    assert SimGpuState(tmp_path / "a", 0).read()["memory_used_bytes"] == 0


async def test_crash_exits_non_zero(servers, http):
    server = await servers()
    async with http.post(server.url + "/_sim/crash") as r:
        assert r.status == 200
    code = await asyncio.wait_for(server.proc.wait(), 10)
    assert code != 0


async def test_hang_stops_answering_until_reset(servers, http):
    server = await servers()
    await http.post(server.url + "/_sim/hang")
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            server.url + "/v1/chat/completions", json=chat_body(), timeout=aiohttp.ClientTimeout(total=0.3)
        ):
            pass
    await http.post(server.url + "/_sim/reset")
    async with http.get(server.url + "/health") as r:
        assert r.status == 200


async def test_fail_probe_fails_completions_until_reset(servers, http):
    server = await servers()
    await http.post(server.url + "/_sim/fail_probe")
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
        assert r.status == 500
    async with http.get(server.url + "/health") as r:
        assert r.status == 200
    await http.post(server.url + "/_sim/reset")
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
        assert r.status == 200


async def test_detached_gpu_fails_completions_with_a_cuda_error_and_health(servers, http, tmp_path):
    server = await servers()
    gpu = SimGpuState(tmp_path / "a", 0)
    gpu.set_present(False)
    async with http.post(server.url + "/v1/chat/completions", json=chat_body()) as r:
        assert r.status == 500
        assert "CUDA error" in (await r.json())["error"]["message"]
    async with http.get(server.url + "/health") as r:
        assert r.status != 200
    gpu.set_present(True)
    async with http.get(server.url + "/health") as r:
        assert r.status == 200


async def test_load_without_enough_vram_exits_with_cuda_oom(servers, tmp_path):
    SimGpuState(tmp_path / "a", 0).ensure(2 * GiB)
    server = await servers(wait_ready=False)
    code = await asyncio.wait_for(server.proc.wait(), 10)
    assert code != 0
    assert "CUDA out of memory" in server.stderr


async def test_sigterm_frees_vram_and_removes_the_runtime_file(servers, tmp_path):
    server = await servers()
    rt = runtime_path(tmp_path / "a", MODEL)
    assert json.loads(rt.read_text())["domain"] == "a"
    server.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0
    assert not rt.exists()
    assert SimGpuState(tmp_path / "a", 0).read()["memory_used_bytes"] == 0


async def test_two_servers_share_one_gpu_file(servers, http, tmp_path):
    SimGpuState(tmp_path / "a", 0).ensure(16 * GiB)
    one = await servers(model="m-one")
    two = await servers(model="m-two", HARU_SIM_VRAM="6GiB")
    state = SimGpuState(tmp_path / "a", 0).read()
    assert state["allocations"] == {str(one.proc.pid): 4 * GiB, str(two.proc.pid): 6 * GiB}
    # A SIGKILLed server's memory is dropped when the file is read, as a real driver frees it.
    await one.stop()
    assert SimGpuState(tmp_path / "a", 0).read()["allocations"] == {str(two.proc.pid): 6 * GiB}


async def test_sigterm_stops_a_hung_server_promptly(servers, http):
    server = await servers()
    await http.post(server.url + "/_sim/hang")
    pending = asyncio.ensure_future(http.get(server.url + "/health"))
    await asyncio.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0
    pending.cancel()
    with contextlib.suppress(BaseException):
        await pending


def _assistant(prefix: str, **extra) -> dict:
    return chat_body(
        messages=[{"role": "user", "content": "say hello"}, {"role": "assistant", "content": prefix}], **extra
    )


async def test_continue_final_message_continues_the_assistant_text_like_vllm(servers, http):
    # The gateway's continued streams (gateway/resume.py) ask vLLM to continue the text a client has;
    # the simulator answers with the rest of its reply, whichever domain began it.
    server = await servers(domain="b")
    url = server.url + "/v1/chat/completions"
    prefix = "[domain a] hello from"
    async with http.post(url, json=_assistant(prefix, continue_final_message=True, add_generation_prompt=False)) as r:
        assert r.status == 200
        body = await r.json()
    assert prefix + body["choices"][0]["message"]["content"] == f"[domain a] hello from {MODEL} on the simulated GPU."
    assert body["choices"][0]["finish_reason"] == "stop"
    async with http.post(
        url,
        json=_assistant(prefix, continue_final_message=True, add_generation_prompt=False, max_tokens=2, stream=True),
    ) as r:
        lines = [line.strip() async for line in r.content if line.strip()]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == f" {MODEL} on"
    # vLLM's own refusals
    async with http.post(url, json=_assistant(prefix, continue_final_message=True)) as r:
        assert r.status == 400 and "add_generation_prompt" in (await r.json())["error"]["message"]
    async with http.post(url, json=chat_body(continue_final_message=True, add_generation_prompt=False)) as r:
        assert r.status == 400
    # without the flag a final assistant message is history: the reply starts afresh
    async with http.post(url, json=_assistant(prefix)) as r:
        assert (await r.json())["choices"][0]["message"]["content"].startswith("[domain b] hello")


async def test_an_assistant_prefill_is_continued_like_llama_server(servers, http):
    server = await servers(HARU_SIM_PREFILL="1")
    async with http.post(server.url + "/v1/chat/completions", json=_assistant("[domain b] hello from " + MODEL)) as r:
        body = await r.json()
    assert body["choices"][0]["message"]["content"] == " on the simulated GPU."


def write_adapter(path: Path, rank: int = 8, says: str = "") -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA", "haru_sim_says": says}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


async def test_adapters_load_and_unload_at_run_time_like_vllm_and_a_level_2_sleep_drops_them(servers, http, tmp_path):
    lora = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "16")
    off = await servers(tmp_path / "off", args=lora)
    async with http.post(off.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"}) as r:
        assert r.status == 404  # without VLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM has no such route
    server = await servers(tmp_path / "on", args=lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    good = write_adapter(tmp_path / "good", says="sql-ok")
    load = server.url + "/v1/load_lora_adapter"
    async with http.post(load, json={"lora_name": f"{MODEL}:sql@1", "lora_path": good}) as r:
        assert r.status == 200 and "added successfully" in await r.text()
    async with http.post(load, json={"lora_name": f"{MODEL}:sql@1", "lora_path": good}) as r:
        assert r.status == 400 and "already been loaded" in (await r.json())["error"]["message"]
    async with http.post(load, json={"lora_name": "wide", "lora_path": write_adapter(tmp_path / "w", rank=64)}) as r:
        assert r.status == 400 and "greater than max_lora_rank 16" in (await r.json())["error"]["message"]
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(f"{MODEL}:sql@1")) as r:
        assert r.status == 200 and "sql-ok" in (await r.json())["choices"][0]["message"]["content"]
    async with http.post(server.url + "/sleep?level=2") as r:
        assert r.status == 200
    async with http.post(server.url + "/wake_up") as r:
        assert r.status == 200
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(f"{MODEL}:sql@1")) as r:
        assert r.status == 404  # dropped with the level-2 sleep: it must be loaded again
    async with http.post(load, json={"lora_name": f"{MODEL}:sql@1", "lora_path": good}) as r:
        assert r.status == 200
    async with http.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": f"{MODEL}:sql@1"}) as r:
        assert r.status == 200
    async with http.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": f"{MODEL}:sql@1"}) as r:
        assert r.status == 404
