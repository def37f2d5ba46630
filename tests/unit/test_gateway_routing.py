"""The gateway's routing table and status table: pure, no sockets. Given a view and an intent,
when resolving (fleet, model) at a time, then this Forward or this Refusal."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from haru.core.errors import ConfigError
from haru.core.openai_errors import ANSWER_STATUS, answer_status, error_body
from haru.core.residency import Answer, Loading, Lost, NotAdmitted, Resident, Unknown
from haru.core.views import DomainView, FleetView, ModelView, RouteIntent, Target
from haru.gateway.config import from_env
from haru.gateway.routing import (
    LOST_RETRY_S,
    Forward,
    Refusal,
    RoutingTable,
    base_url,
    model_of,
    retry_after_warming,
)
from haru.gateway.truth import describe_state, models_list, truth_table

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NOW = T0.timestamp()
M = "qwen3.6:27b"
S = "small"


def view(active: str = "a", *, seq: int = 1, models_b: tuple[str, ...] = (M, S)) -> FleetView:
    def dom(name: str, models: tuple[str, ...]) -> DomainView:
        return DomainView(
            name=name,
            serving_url=f"http://{name}:8000",
            models={m: ModelView(name=m, residency=Resident(since=T0)) for m in models},
        )

    return FleetView(
        fleet="f", domains={"a": dom("a", (M, S)), "b": dom("b", models_b)}, active=active, route_revision=seq, seq=seq
    )


def intent(
    answers: dict[str, Answer],
    *,
    domain: str = "a",
    revision: int = 4,
    serve: str = "agent",
    url: str | None = None,
    model_urls: dict[str, str] | None = None,
    operation: str = "",
) -> RouteIntent:
    return RouteIntent(
        fleet="f",
        revision=revision,
        active=Target(
            domain=domain,
            serving_url=f"http://{domain}:8000/" if url is None else url,
            serve=serve,
            model_urls=model_urls or {},
        ),
        answers=answers,
        operation=operation,
    )


def table(v: FleetView | None, i: RouteIntent | None, seq: int = 1) -> RoutingTable:
    t = RoutingTable()
    if v is not None:
        t.set_view("f", v)
    if i is not None:
        t.set_intent("f", i, seq)
    return t


READY = Answer(answer="ready")


def test_ready_forwards_to_the_active_serving_url_without_trailing_slash():
    got = table(view(), intent({M: READY, S: READY})).resolve("f", M, NOW)
    assert got == Forward("http://a:8000", "f", "a", M, 4)


@pytest.mark.parametrize(
    "answer, key",
    [
        (Answer(answer="warming", since=T0), "warming"),
        (Answer(answer="asleep"), "asleep"),
        (Answer(answer="lost", reason="gpu_detached"), "lost:gpu_detached"),
        (Answer(answer="lost", reason="evicted"), "lost"),
        (Answer(answer="lost", reason="failed", detail="CUDA out of memory"), "lost"),
        (Answer(answer="not_admitted", short_by_bytes=5), "not_admitted"),
        (Answer(answer="unknown"), "unknown"),
    ],
)
def test_each_router_answer_maps_to_the_status_table(answer, key):
    got = table(view(), intent({M: answer, S: READY})).resolve("f", M, NOW + 1)
    assert isinstance(got, Refusal)
    assert (got.status, got.code) == ANSWER_STATUS[key]
    assert got.domain == "a" and M in got.message


def test_the_table_is_the_design_contract():
    assert ANSWER_STATUS == {
        "warming": (503, "model_warming"),
        "asleep": (503, "model_asleep"),
        "lost:gpu_detached": (503, "gpu_detached"),
        "lost": (503, "model_lost"),
        "not_admitted": (409, "model_not_admitted"),
        "unknown": (503, "residency_unknown"),
    }


def test_warming_retry_after_grows_with_how_long_and_is_bounded():
    since = T0
    t = table(view(), intent({M: Answer(answer="warming", since=since, reason="waking"), S: READY}))
    early = t.resolve("f", M, NOW + 0.3)
    later = t.resolve("f", M, NOW + 47)
    much_later = t.resolve("f", M, NOW + 3600)
    assert early.retry_after == 1 and "for 0.3 s" in early.message and "waking" in early.message
    assert later.retry_after == 12 and "for 47.0 s" in later.message
    assert much_later.retry_after == 30
    assert [retry_after_warming(ms) for ms in (0, 4000, 4001, 10**9)] == [1, 1, 2, 30]


def test_warming_without_since_uses_the_intents_for_ms():
    got = table(view(), intent({M: Answer(answer="warming", for_ms=8000), S: READY})).resolve("f", M, NOW)
    assert got.retry_after == 2 and "for 8.0 s" in got.message


def test_gpu_detached_says_it_is_the_providers_doing_and_lost_carries_reason_and_detail():
    t = table(
        view(),
        intent(
            {
                M: Answer(answer="lost", reason="gpu_detached"),
                S: Answer(answer="lost", reason="process_exited", detail="exit status -9"),
            }
        ),
    )
    detached, exited = t.resolve("f", M, NOW), t.resolve("f", S, NOW)
    assert "not the operator's doing" in detached.message and "provider" in detached.message
    assert "process_exited: its runtime process is gone (exit status -9)" in exited.message
    assert detached.retry_after == exited.retry_after == LOST_RETRY_S  # a lost model comes back: say when to ask


def test_evicted_says_the_box_is_over_committed():
    got = table(view(), intent({M: Answer(answer="lost", reason="evicted"), S: READY})).resolve("f", M, NOW)
    assert (got.status, got.code) == (503, "model_lost") and got.retry_after == LOST_RETRY_S
    assert "this box is over-committed" in got.message and "evicted" in got.message


def test_not_admitted_is_409_never_retryable_with_the_shortfall():
    got = table(view(), intent({M: Answer(answer="not_admitted", short_by_bytes=int(14.8 * 2**30)), S: READY})).resolve(
        "f", M, NOW
    )
    assert got.status == 409 and not got.retryable and got.retry_after is None
    assert "short by 14.8 GiB" in got.message and "never fit" in got.message


def test_unknown_fleet_and_unknown_model_are_404():
    t = table(view(), intent({M: READY, S: READY}))
    fleet = t.resolve("nope", M, NOW)
    assert (fleet.status, fleet.code) == (404, "fleet_not_found") and "'f'" in fleet.message
    model = t.resolve("f", "gpt-4", NOW)
    assert (model.status, model.code) == (404, "model_not_found") and "'qwen3.6:27b'" in model.message
    assert (RoutingTable().resolve("f", M, NOW).code) == "fleet_not_found"


def test_model_ids_match_exactly():
    t = table(view(), intent({M: READY, S: READY}))
    assert t.resolve("f", "Qwen3.6:27b", NOW).code == "model_not_found"


def test_a_model_only_on_the_standby_is_not_found_here_and_says_where():
    v = view(models_b=(M, S, "extra"))
    got = table(v, intent({M: READY, S: READY})).resolve("f", "extra", NOW)
    assert got.code == "model_not_found" and "only on domain 'b'" in got.message


def test_a_declared_model_without_an_answer_yet_is_residency_unknown():
    got = table(view(), intent({M: READY})).resolve("f", S, NOW)
    assert got.code == "residency_unknown" and "no answer" in got.message


def test_no_active_domain():
    t = table(view(active=""), RouteIntent(fleet="f", active=None))
    for model in (M, S):
        got = t.resolve("f", model, NOW)
        assert (got.status, got.code) == (503, "no_active_domain") and "promote" in got.message
    assert t.resolve("f", "not-declared", NOW).code == "model_not_found"
    empty = table(None, RouteIntent(fleet="f", active=None))
    assert empty.resolve("f", M, NOW).code == "no_active_domain"


def test_view_without_intent_routes_nothing_and_says_why():
    got = table(view(), None).resolve("f", M, NOW)
    assert got.code == "residency_unknown" and "projector" in got.message


def test_intent_without_view_still_routes():
    got = table(None, intent({M: READY})).resolve("f", M, NOW)
    assert isinstance(got, Forward) and got.domain == "a"


def test_serve_direct_uses_the_model_url_and_refuses_without_one():
    t = table(view(), intent({M: READY, S: READY}, serve="direct", model_urls={M: "http://10.0.0.5:8101/v1/"}))
    assert t.resolve("f", M, NOW) == Forward("http://10.0.0.5:8101", "f", "a", M, 4)
    missing = t.resolve("f", S, NOW)
    assert (missing.status, missing.code) == (502, "upstream_unreachable") and "serve: direct" in missing.message


def test_an_active_domain_without_serving_url_is_502():
    got = table(view(), intent({M: READY}, url="")).resolve("f", M, NOW)
    assert got.code == "upstream_unreachable" and "no serving URL" in got.message


def test_a_pointer_move_applies_to_the_next_resolve_and_older_updates_are_ignored():
    t = table(view(), intent({M: READY}), seq=10)
    assert t.resolve("f", M, NOW).domain == "a"
    assert t.set_intent("f", intent({M: READY}, domain="b", revision=9), 11)
    assert t.resolve("f", M, NOW) == Forward("http://b:8000", "f", "b", M, 9)
    assert not t.set_intent("f", intent({M: READY}, domain="a"), 10)  # a stale redelivery
    assert t.resolve("f", M, NOW).domain == "b"
    assert t.set_view("f", view(seq=5))
    assert not t.set_view("f", view(seq=4))
    assert t.get("f").view.seq == 5
    t.set_view("f", None)
    assert t.get("f").view is None and t.resolve("f", M, NOW).domain == "b"
    t.set_intent("f", None)
    assert t.resolve("f", M, NOW).code == "fleet_not_found"


def test_base_url():
    assert [base_url(u) for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/")] == ["http://h:1"] * 4


def test_error_body_is_openais_shape():
    body = msgspec.json.decode(error_body(409, "model_not_admitted", "no", "model"))
    assert body == {
        "error": {"message": "no", "type": "conflict_error", "param": "model", "code": "model_not_admitted"}
    }
    assert msgspec.json.decode(error_body(503, "x", "m"))["error"]["type"] == "service_unavailable_error"
    assert msgspec.json.decode(error_body(504, "x", "m"))["error"]["type"] == "upstream_error"
    # a 404 is OpenAI's invalid_request_error (what api.openai.com says for an unknown model)
    assert (
        msgspec.json.decode(error_body(404, "model_not_found", "m", "model"))["error"]["type"]
        == "invalid_request_error"
    )


def test_every_residency_state_the_serving_port_refuses_reads_the_gateways_row():
    from haru.core.residency import ANSWERS

    for state, (answer, _meaning) in ANSWERS.items():
        if answer == "ready":
            continue
        assert answer_status(answer) == ANSWER_STATUS[answer], state
    assert answer_status("lost", "gpu_detached") == (503, "gpu_detached")
    assert answer_status("lost", "evicted") == (503, "model_lost")
    assert answer_status("no-such-answer") == (503, "residency_unknown")


@pytest.mark.parametrize(
    "body, words, param",
    [
        (b'{"model": 1}', "Expected `str`, got `int` - at `$.model`", "model"),
        (b'{"messages": []}', "Object missing required field `model`", "model"),
        (b'{"model": ""}', "`model` is empty - at `$.model`", "model"),
        (b'{"model": "x"', "not valid JSON", None),
        (b'"model"', "Expected `object`, got `str`", None),
        (b"  ", "empty", None),
    ],
)
def test_model_of_names_what_is_wrong_and_where(body, words, param):
    got = model_of(body)
    assert isinstance(got, Refusal) and got.status == 400 and got.code == "invalid_request"
    assert words in got.message and got.param == param


def test_model_of_reads_only_model():
    assert model_of(b'{"messages": [{"role": "user"}], "model": "m", "anything": {"deep": [1, 2]}}') == "m"


def test_models_list_and_truth_table():
    since = T0 - timedelta(seconds=90)
    v = FleetView(
        fleet="f",
        active="a",
        seq=3,
        domains={
            "a": DomainView(
                name="a",
                serving_url="http://a",
                models={
                    M: ModelView(name=M, residency=Resident(since=since)),
                    S: ModelView(name=S, residency=Loading(since=since, attempt=2)),
                },
            ),
            "b": DomainView(name="b", models={M: ModelView(name=M, residency=NotAdmitted(short_by_bytes=2**30))}),
        },
    )
    t = table(v, intent({M: READY, S: Answer(answer="warming", since=since, reason="loading")}))
    listing = models_list(t.get("f"), NOW)
    assert [m["id"] for m in listing["data"]] == [M, S] and listing["object"] == "list"
    assert listing["data"][1]["haru"]["answer"]["for_ms"] == 90_000
    assert listing["data"][1]["haru"]["retry_after"] == 23
    truth = truth_table([t.get("f")], NOW)["fleets"]["f"]
    a = truth["domains"]["a"]["models"]
    assert a[S]["residency"]["summary"] == "loading for 90s (attempt 2)" and a[S]["code"] == "model_warming"
    assert truth["domains"]["b"]["models"][M]["residency"]["summary"] == "not admitted — short by 1.0 GiB"


def test_describe_state():
    assert describe_state(Unknown(), NOW)["summary"] == "unknown (never probed)"
    lost = describe_state(Lost(reason="evicted", detail="oom", since=T0 - timedelta(hours=3)), NOW)
    assert lost["state"] == "lost" and lost["reason"] == "evicted" and lost["summary"] == "lost (evicted: oom) for 3.0h"


def test_config_from_env():
    c = from_env(
        {
            "HARU_API_TOKEN": "t",
            "HARU_CHAT_MAX_BODY_BYTES": "10",
            "HARU_CHAT_HEADER_TIMEOUT_MS": "600000",
            "HARU_DEFAULT_FLEET": "prod",
        }
    )
    assert (c.host, c.port, c.max_body_bytes, c.header_timeout_ms, c.default_fleet) == (
        "0.0.0.0",
        8700,
        10,
        600000,
        "prod",
    )
    assert c.bind_host() == "0.0.0.0"
    open_ = from_env({}, host="0.0.0.0", port=9)
    assert open_.open and open_.bind_host() == "127.0.0.1" and open_.port == 9
    with pytest.raises(ConfigError, match="HARU_CHAT_MAX_BODY_BYTES='lots' is not an integer"):
        from_env({"HARU_CHAT_MAX_BODY_BYTES": "lots"})


def test_a_lora_adapter_routes_as_its_model_does():
    """vLLM serves a model's LoRA adapters under their own names (`--lora-modules name=path`): a request
    naming one goes where its model's would, and gets its model's refusal when the model cannot serve."""
    v = view()
    a = v.domains["a"]
    models = dict(a.models)
    models[M] = msgspec.structs.replace(models[M], adapters=["sql-lora"])
    v = msgspec.structs.replace(v, domains={**v.domains, "a": msgspec.structs.replace(a, models=models)})
    assert table(v, intent({M: READY, S: READY})).resolve("f", "sql-lora", NOW) == Forward(
        "http://a:8000", "f", "a", M, 4
    )
    refused = table(v, intent({M: Answer(answer="asleep"), S: READY})).resolve("f", "sql-lora", NOW)
    assert isinstance(refused, Refusal) and refused.code == "model_asleep"
    assert isinstance(table(v, intent({M: READY, S: READY})).resolve("f", "other-lora", NOW), Refusal)
