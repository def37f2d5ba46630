"""Token usage, pure (gateway/usage.py): read from JSON and SSE bodies as they go by, and rewritten for
a continued stream so that it says what the client's request cost."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from haru.agents.sim.vllm_completions import split_tokens
from haru.gateway.resume import Transcript, continuation_request, splice_event
from haru.gateway.usage import (
    Counted,
    Usage,
    UsageTap,
    count_of,
    count_requests,
    llama_tokenize_body,
    prompt_of,
    spliced_usage,
    usage_of,
)


def sse(*objs: object) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


CHUNK = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}


def test_the_usage_of_a_json_body_is_read_and_nothing_else_is_needed():
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "a"}}], **USAGE}).encode()
    assert usage_of(body) == Usage(7, 9)
    assert usage_of(b'{"id": "x"}') is None
    assert usage_of(b'{"usage": null}') is None
    assert usage_of(b'not json "usage"') is None
    assert usage_of(b'{"usage": {"prompt_tokens": "seven"}}') is None  # not a count: not counted


def test_an_sse_body_yields_its_usage_event_wherever_the_pieces_are_cut():
    body = sse(CHUNK, CHUNK, {"choices": [], "usage": None}, USAGE, b"[DONE]")
    for cut in range(1, len(body)):
        tap = UsageTap()
        tap.feed(body[:cut])
        tap.feed(body[cut:])
        assert tap.usage == Usage(7, 9), cut
    none = UsageTap()
    none.feed(sse(CHUNK, b"[DONE]"))
    assert none.usage is None


def test_with_usage_in_every_chunk_the_last_which_is_cumulative_counts():
    tap = UsageTap()
    for n in range(1, 5):
        tap.feed(sse({**CHUNK, "usage": {"prompt_tokens": 7, "completion_tokens": n}}))
    assert tap.usage == Usage(7, 4)


def test_a_continuations_usage_counts_the_original_prompt_and_every_token_the_client_received():
    own = {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35, "prompt_tokens_details": {"cached": 20}}
    assert spliced_usage(own, Counted(prompt=12, received=18), chunks=17) == {
        "prompt_tokens": 12,
        "completion_tokens": 23,
        "total_tokens": 35,
    }
    # no tokenizer: the chunks stand for tokens, the continuation's prompt less them for the prompt
    assert spliced_usage(own, None, chunks=17) == {"prompt_tokens": 13, "completion_tokens": 22, "total_tokens": 35}
    assert spliced_usage({"prompt_tokens": None}, None, 3) == {"prompt_tokens": None}  # not a count: untouched


def test_a_spliced_usage_event_carries_the_whole_requests_usage():
    sent = Transcript(id="chatcmpl-a", created=5, text="Once upon", role_sent=True, chunks=2)
    cont = {"id": "chatcmpl-b", "created": 9, "choices": [], "usage": {"prompt_tokens": 14, "completion_tokens": 3}}
    out = splice_event(json.dumps(cont).encode(), sent, Counted(prompt=12, received=2))
    assert out is not None
    obj = json.loads(out[6:])
    assert obj["id"] == "chatcmpl-a" and obj["created"] == 5
    assert obj["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def test_max_tokens_is_lessened_by_the_counted_tokens_when_there_are_some():
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    sent = Transcript(text="a b c", chunks=3)
    assert continuation_request(request, sent, "vllm")["max_tokens"] == 47
    assert continuation_request(request, sent, "vllm", received=5)["max_tokens"] == 45
    assert continuation_request(request, sent, "vllm", received=80)["max_tokens"] == 1


def test_the_tokenizer_calls_follow_each_runtimes_api():
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}
    cont = continuation_request(request, Transcript(text="Hel", chunks=1), "vllm")
    (p1, b1), (p2, b2) = count_requests("vllm", request, cont)
    assert p1 == p2 == "/tokenize"
    assert b1 == {
        "model": "m",
        "messages": request["messages"],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"x": 1},
    }
    assert b2["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert b2["continue_final_message"] is True and b2["add_generation_prompt"] is False
    llama = count_requests(
        "llama_server", request, continuation_request(request, Transcript(text="Hel"), "llama_server")
    )
    assert [p for p, _ in llama] == ["/apply-template", "/apply-template"]
    assert llama[1][1]["messages"][-1]["role"] == "assistant" and all(b["model"] == "m" for _, b in llama)
    assert llama_tokenize_body("m", "<s>hi") == {
        "model": "m",
        "content": "<s>hi",
        "add_special": True,
        "parse_special": True,
    }
    assert count_of({"count": 4, "tokens": [1, 2, 3, 4], "max_model_len": 9}) == 4
    assert count_of({"tokens": [1, 2]}) == 2
    assert count_of({"error": "no"}) is None and count_of([1]) is None
    assert prompt_of({"prompt": "<s>hi"}) == "<s>hi" and prompt_of({}) is None


@given(st.text())
def test_the_simulators_tokens_give_the_text_back(text):
    assert "".join(split_tokens(text)) == text
