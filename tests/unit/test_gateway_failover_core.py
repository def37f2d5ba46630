"""The pure parts of a failover clients do not see: when to hold and for how long (gateway/hold.py),
and how a cut stream is read, continued and spliced (gateway/resume.py)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from haru.core.residency import Answer, Loading, Lost, Resident, Sleeping
from haru.core.specs import Policy
from haru.core.views import DomainView, FleetView, ModelView, OperationView, RouteIntent, Target
from haru.gateway.hold import MARGIN_MS, Holds, back_since, goes_on, heard_again, hold_plan
from haru.gateway.metrics import GatewayMetrics
from haru.gateway.resume import (
    boundary,
    continuation_body,
    error_event,
    events,
    not_continuable,
    splice_event,
    transcript,
)
from haru.gateway.routing import Forward, Refusal, compile_routes

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
M = "m1"
DEFAULT_POLICY = Policy()  # frozen: one instance serves as every call's default


def routes(
    *,
    policy: Policy = DEFAULT_POLICY,
    wake_ms: int = 400,
    standby=None,
    operation=None,
    last_operation=None,
    b_reachable: bool | None = True,
    b_eligible: bool = True,
    a_reachable: bool | None = True,
    reload_ms: int = 30_000,
):
    a = DomainView(
        name="a",
        serving_url="http://a",
        reachable=a_reachable,
        models={M: ModelView(name=M, admitted=True, residency=Lost(reason="process_exited"), load_ms=reload_ms)},
    )
    b = DomainView(
        name="b",
        serving_url="http://b",
        reachable=b_reachable,
        eligible=b_eligible,
        models={M: ModelView(name=M, admitted=True, residency=standby or Sleeping(since=NOW), wake_ms=wake_ms)},
    )
    view = FleetView(
        fleet="f",
        policy=policy,
        domains={"a": a, "b": b},
        active="a",
        route_revision=1,
        seq=1,
        operation=operation,
        last_operation=last_operation,
    )
    intent = RouteIntent(
        fleet="f",
        revision=1,
        active=Target(domain="a", serving_url="http://a"),
        answers={M: Answer(answer="lost", reason="process_exited")},
    )
    return compile_routes("f", view, intent, 1)


T = NOW.timestamp()


def test_a_lost_model_is_held_for_the_standbys_measured_wake_and_a_margin():
    plan = hold_plan(routes(wake_ms=400), "model_lost", now=T)
    assert plan is not None and plan.budget_ms == 400 + MARGIN_MS and "b" in plan.why


def test_an_unreachable_active_adds_the_heartbeat_timeout_until_its_silence_is_noticed():
    assert hold_plan(routes(), "upstream_unreachable", unreachable=True, now=T).budget_ms == 5_000 + 400 + MARGIN_MS
    noticed = routes(a_reachable=False)
    assert hold_plan(noticed, "upstream_unreachable", unreachable=True, now=T).budget_ms == 400 + MARGIN_MS


def test_the_hold_is_bounded_by_policy():
    unmeasured = hold_plan(routes(wake_ms=0), "upstream_unreachable", unreachable=True, now=T)
    assert unmeasured.budget_ms == 30_000  # a wake never measured: the ceiling
    assert hold_plan(routes(wake_ms=29_000), "model_lost", now=T).budget_ms == 30_000
    assert hold_plan(routes(policy=Policy(hold_ms=700)), "model_lost", now=T).budget_ms == 700
    assert hold_plan(routes(policy=Policy(hold_max_ms=0)), "model_lost", now=T) is None


@pytest.mark.parametrize(
    "kw",
    [
        dict(policy=Policy(auto_failover=False)),
        dict(standby=Lost(reason="evicted")),
        dict(standby=Loading(since=NOW)),
        dict(b_reachable=None),
        dict(b_eligible=False),
    ],
)
def test_nothing_is_held_when_no_failover_is_coming(kw):
    assert hold_plan(routes(**kw), "model_lost", now=T) is None


def test_answers_a_failover_does_not_cure_are_not_held():
    for code in ("model_not_admitted", "model_warming", "model_asleep", "residency_unknown", "no_active_domain"):
        assert hold_plan(routes(), code, now=T) is None


def test_a_promotion_under_way_holds_warming_and_asleep_too():
    op = OperationView(op_id="o", kind="promotion", target="b", source="a")
    for code in ("model_warming", "model_asleep", "model_lost"):
        assert hold_plan(routes(operation=op), code, now=T) is not None
    # even with auto-failover off: a manual promotion is under way
    assert hold_plan(routes(operation=op, policy=Policy(auto_failover=False)), "model_lost", now=T) is not None


def test_a_promotion_that_just_aborted_means_nothing_is_about_to_start():
    aborted = OperationView(
        op_id="o", kind="promotion", target="b", source="a", state="aborted", finished_at=NOW - timedelta(seconds=1)
    )
    assert hold_plan(routes(last_operation=aborted), "model_lost", now=T) is None
    later = T + 61
    assert hold_plan(routes(last_operation=aborted), "model_lost", now=later) is not None


def test_what_aborted_holds_back_a_failover_as_the_promoter_does():
    """The promoter's rule (retry_after_abort): an automatic promotion that aborted within its fast retries is
    tried again in failover_retry_ms, so a request holds for it; past them it waits retry_ms, as a manual
    one does; an aborted demotion of the standby holds nothing back (the promoter fails over at once)."""
    ago = NOW - timedelta(seconds=1)

    def aborted(kind: str, reason: str, attempt: int = 1) -> OperationView:
        return OperationView(
            op_id="o",
            kind=kind,
            target="b",
            source="a",
            state="aborted",
            finished_at=ago,
            reason=reason,
            attempt=attempt,
        )

    retries = Policy().failover_retry_attempts
    assert hold_plan(routes(last_operation=aborted("promotion", "domain_unreachable")), "model_lost", now=T)
    tired = aborted("promotion", "domain_unreachable", attempt=retries)
    assert hold_plan(routes(last_operation=tired), "model_lost", now=T) is None
    for reason in ("manual", "domain_unreachable"):
        demotion = aborted("demotion", reason)
        plan = hold_plan(routes(last_operation=demotion), "upstream_unreachable", unreachable=True, now=T)
        assert plan is not None and plan.target == "b", reason


def test_only_an_estimated_failover_waits_on_past_its_estimate_and_only_with_a_promoter_heard():
    silent = routes(a_reachable=False)
    plan = hold_plan(silent, "upstream_unreachable", unreachable=True, now=T)
    assert plan.target == "b" and plan.estimated
    assert goes_on(plan, promoter_heard=True)
    assert not goes_on(plan, promoter_heard=False)  # nobody to move the route
    assert not goes_on(None, promoter_heard=True)  # the failover is no longer coming
    set_by_operator = hold_plan(routes(a_reachable=False, policy=Policy(hold_ms=700)), "model_lost", now=T)
    assert set_by_operator.target == "b" and not goes_on(set_by_operator, promoter_heard=True)
    # waiting for the silent active to be heard again (no standby) is bounded by hold_max_ms already
    heard = hold_plan(routes(a_reachable=False, b_reachable=None), "upstream_unreachable", unreachable=True, now=T)
    assert heard.target == "" and not goes_on(heard, promoter_heard=True)


class _Table:
    """A routing table of one fleet whose route the test moves to b."""

    def __init__(self, fleet_routes) -> None:
        self.routes = fleet_routes
        self.moved = False

    def get(self, fleet: str):
        return self.routes

    def resolve(self, fleet: str, model: str, now: float) -> Forward | Refusal:
        if self.moved:
            return Forward(url="http://b", fleet="f", domain="b", model=model, revision=2)
        return Refusal(503, "upstream_unreachable", "a is unreachable")


FIRST = Refusal(503, "upstream_unreachable", "a is unreachable")
QUICK = Policy(hold_max_ms=4_000)  # the estimate: a's silence noticed already, b wakes in 50 ms, a 1 s margin


async def held(promoter_heard: bool, move_after_s: float | None = None) -> tuple[Forward | Refusal, float]:
    """A request held on an unreachable active whose silence was noticed (the estimate: b's 50 ms wake and the
    1 s margin), the route moved to b after `move_after_s` (None: never); what the hold gave, and when."""
    table = _Table(routes(a_reachable=False, wake_ms=50, policy=QUICK))
    holds = Holds(table, GatewayMetrics(), promoter_heard=lambda: promoter_heard)  # type: ignore[arg-type]
    if move_after_s is not None:
        asyncio.get_running_loop().call_later(move_after_s, lambda: (setattr(table, "moved", True), holds.changed("f")))
    started = time.monotonic()
    plan = hold_plan(table.routes, FIRST.code, unreachable=True, now=T)
    out = await holds.hold("f", M, 10, plan, FIRST, lambda f: True, unreachable=True)
    return out, time.monotonic() - started


@pytest.mark.timeout(20)
async def test_a_hold_whose_estimate_ran_out_waits_on_for_a_failover_a_promoter_drives():
    out, waited = await held(True, move_after_s=1.6)  # the log's election ends late
    assert isinstance(out, Forward) and out.domain == "b" and waited >= 1.5


@pytest.mark.timeout(20)
@pytest.mark.parametrize("heard", [False, True])
async def test_a_hold_ends_at_its_estimate_with_no_promoter_heard_and_at_hold_max_ms_with_one(heard):
    out, waited = await held(heard)
    assert out == FIRST
    if heard:
        assert 3.9 <= waited < 8.0  # on to hold_max_ms (4 s), no further
    else:
        assert 1.0 <= waited < 3.0  # the estimate: 50 ms wake and the margin


# ------------------------------------------------------------------------------------- streams


def chunk(delta: dict, finish: str | None = None, cid: str = "c1", created: int = 7) -> bytes:
    obj = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": M,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_boundary_is_the_end_of_the_last_whole_event():
    assert boundary(b"data: 1\n\ndata: 2") == 9
    assert boundary(b"data: 1\r\n\r\ndata: 2\r\n\r\n") == 22
    assert boundary(b"data: 1\n") == 0
    assert events(b": comment\n\ndata: 1\n\ndata: 2\r\n\r\n") == [b"1", b"2"]


def test_the_transcript_is_what_the_client_received():
    sent = chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hel"}) + chunk({"content": "lo"})
    t = transcript(sent)
    assert (t.id, t.created, t.text, t.role_sent, t.finished, t.chunks, t.other) == (
        "c1",
        7,
        "Hello",
        True,
        False,
        2,
        "",
    )
    assert transcript(sent + chunk({}, "stop")).finished
    assert not transcript(sent + chunk({}, "stop")).done  # the gateway still owes the client the [DONE]
    assert transcript(sent + b"data: [DONE]\n\n").finished and transcript(sent + b"data: [DONE]\n\n").done
    assert transcript(chunk({"tool_calls": [{"index": 0}]})).other


@pytest.mark.parametrize(
    "request_, why",
    [
        ({"n": 2}, "n > 1"),
        ({"tools": [{}]}, "tools"),
        ({"tool_choice": "auto"}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
        ({"guided_regex": "a+"}, "guided"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
    ],
)
def test_what_cannot_be_continued_faithfully_says_why(request_, why):
    assert why in not_continuable({"model": M, "messages": [], **request_})


def test_plain_requests_can_be_continued():
    assert (
        not_continuable(
            {
                "model": M,
                "messages": [],
                "n": 1,
                "response_format": {"type": "text"},
                "tool_choice": "none",
                "temperature": 0.3,
            }
        )
        == ""
    )


def test_the_continuation_asks_vllm_to_continue_the_assistant_message():
    t = transcript(chunk({"role": "assistant", "content": "Hel"}) + chunk({"content": "lo"}))
    req = {"model": M, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}
    body = json.loads(continuation_body(req, t, "vllm"))
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["stream"] is True and req["messages"][-1]["role"] == "user"
    llama = json.loads(continuation_body(req, t, "llama_server"))
    assert llama["messages"][-1]["content"] == "Hello" and "continue_final_message" not in llama
    prefilled = {
        "model": M,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}],
    }
    assert json.loads(continuation_body(prefilled, t, "vllm"))["messages"][-1]["content"] == "Sure: Hello"


def test_a_spliced_event_keeps_the_first_id_and_drops_the_second_role():
    t = transcript(chunk({"role": "assistant", "content": "Hel"}))
    assert splice_event(events(chunk({"role": "assistant", "content": ""}, cid="c2", created=9))[0], t) is None
    out = splice_event(events(chunk({"role": "assistant", "content": "lo"}, cid="c2", created=9))[0], t)
    obj = json.loads(out[6:])
    assert obj["id"] == "c1" and obj["created"] == 7 and obj["choices"][0]["delta"] == {"content": "lo"}
    assert splice_event(b"[DONE]", t) == b"data: [DONE]\n\n"
    fin = json.loads(splice_event(events(chunk({}, "stop", cid="c2"))[0], t)[6:])
    assert fin["choices"][0]["finish_reason"] == "stop" and fin["id"] == "c1"


def test_the_error_event_has_openais_shape():
    obj = json.loads(error_event("it broke")[6:])
    assert obj == {
        "error": {"message": "it broke", "type": obj["error"]["type"], "param": None, "code": "stream_interrupted"}
    }


def test_measured_figures_in_the_view_are_kept():
    mv = ModelView(name=M, residency=Resident(since=NOW, warmup_ms=5), wake_ms=3, load_ms=4)
    assert msgspec.json.decode(msgspec.json.encode(mv), type=ModelView) == mv


def test_a_cut_before_the_role_chunk_keeps_the_continuations_role_chunk():
    t = transcript(b"")
    first = splice_event(events(chunk({"role": "assistant", "content": ""}, cid="c2"))[0], t)
    assert first is not None and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert splice_event(events(chunk({"role": "assistant", "content": ""}, cid="c2"))[0], t) is None


def test_a_cold_reload_quicker_than_the_standby_is_waited_for_in_place():
    # b wakes in 40 s, a reloads in 300 ms (measured): no failover; the request waits for a's reload
    quick = routes(wake_ms=40_000, reload_ms=300)
    plan = hold_plan(quick, "model_lost", now=T)
    assert plan is not None and "a reloads its lost models in place" in plan.why
    # the restart's backoff doubles with each crash in a row: the longest, within the ceiling
    assert plan.budget_ms == min(300 + Policy().restart_backoff_max_ms + MARGIN_MS, Policy().hold_max_ms)
    short = routes(wake_ms=40_000, reload_ms=300, policy=Policy(restart_backoff_max_ms=4_000))
    assert hold_plan(short, "model_lost", now=T).budget_ms == 300 + 4_000 + MARGIN_MS
    too_slow = routes(wake_ms=40_000, reload_ms=29_000)  # + the first backoff + margin > hold_max_ms
    assert hold_plan(too_slow, "model_lost", now=T) is None
    assert hold_plan(quick, "model_warming", now=T) is not None  # the restart under way
    assert hold_plan(routes(wake_ms=40_000, reload_ms=300, policy=Policy(hold_max_ms=0)), "model_lost", now=T) is None
    unmeasured = routes(wake_ms=40_000, reload_ms=0)
    assert hold_plan(unmeasured, "model_lost", now=T) is None  # nobody knows how long it takes
    view = quick.view
    for other in (Lost(reason="gpu_detached_elsewhere"), Sleeping(since=NOW), Loading(attempt=1)):
        a = view.domains["a"]
        odd = msgspec.structs.replace(a, models={M: msgspec.structs.replace(a.models[M], residency=other)})
        changed = msgspec.structs.replace(quick, view=msgspec.structs.replace(view, domains={**view.domains, "a": odd}))
        assert hold_plan(changed, "model_lost", now=T) is None, other


def test_a_loss_the_promoter_waits_out_is_not_held():
    slow = routes(wake_ms=40_000)  # the standby wakes slower than the active reloads (30 s): no faster path
    assert hold_plan(slow, "model_lost", now=T) is None
    assert hold_plan(slow, "upstream_unreachable", unreachable=True, now=T) is not None  # silence: failed at once
    # a wake never measured: the promoter's estimate decides, as it does for the promotion itself
    unmeasured = routes(wake_ms=0)  # b declares no VRAM: the 500 ms probe alone beats the 30 s reload
    assert hold_plan(unmeasured, "model_lost", now=T) is not None
    too_slow = routes(wake_ms=0, policy=Policy(probe_estimate_ms=31_000))
    assert hold_plan(too_slow, "model_lost", now=T) is None


def test_a_model_is_back_once_resident_again_after_the_request_died():
    back = routes(standby=Resident(since=NOW))
    assert back_since(back, "b", M, NOW.timestamp()) and back_since(back, "b", M, NOW.timestamp() - 5)
    assert not back_since(back, "b", M, NOW.timestamp() + 1)  # resident since before it died: the old runtime
    assert not back_since(back, "a", M, 0)  # lost
    assert not back_since(back, "c", M, 0) and not back_since(back, "b", "other", 0) and not back_since(None, "b", M, 0)


def test_a_silent_active_with_no_standby_to_take_over_is_waited_for_until_heard_again():
    """Its requests were failed as stranded (the view called it unreachable), but its serving link may be
    fine: with no failover to wait for, a request waits for its heartbeats, within the ceiling."""
    alone = routes(a_reachable=False, b_reachable=False)
    plan = hold_plan(alone, "upstream_unreachable", unreachable=True, now=T)
    assert plan is not None and plan.budget_ms == 30_000 and "a heard again" in plan.why
    assert (
        hold_plan(
            routes(a_reachable=False, b_reachable=False, policy=Policy(hold_ms=700)), "x", unreachable=True, now=T
        ).budget_ms
        == 700
    )
    # a refused connection to an active the view still calls reachable is answered at once, as before
    assert hold_plan(routes(b_reachable=False), "upstream_unreachable", unreachable=True, now=T) is None


def test_a_domain_is_heard_again_only_after_the_view_called_it_unreachable():
    judged = [False]
    assert not heard_again(routes(), "a", judged)  # reachable all along: nothing came back
    assert not heard_again(routes(a_reachable=False), "a", judged) and judged == [True]
    op = OperationView(op_id="o", kind="promotion", target="b", source="a")
    assert not heard_again(routes(operation=op), "a", judged)  # a failover under way: wait for its end
    assert heard_again(routes(), "a", judged)
    assert not heard_again(routes(a_reachable=None), "a", [True])  # unknown is not heard
    assert not heard_again(None, "a", [True])


def _active_model(r, residency):
    """`r` with the active's model in `residency` (what the view says of it)."""
    view = r.view
    a = view.domains["a"]
    odd = msgspec.structs.replace(a, models={M: msgspec.structs.replace(a.models[M], residency=residency)})
    return msgspec.structs.replace(r, view=msgspec.structs.replace(view, domains={**view.domains, "a": odd}))


def test_a_runtime_the_active_says_is_gone_is_waited_for_in_place_when_no_failover_comes():
    # The serving port answered X-Haru-Runtime-Gone: the runtime was killed, the agent restarts it. The
    # standby is not ready (or a promotion onto it just aborted): nothing moves the route, the reload does.
    backoff_max = Policy().restart_backoff_max_ms
    for kw in (
        dict(standby=Loading(since=NOW)),
        dict(policy=Policy(auto_failover=False)),
        dict(
            last_operation=OperationView(
                op_id="o",
                kind="promotion",
                target="b",
                source="a",
                state="aborted",
                finished_at=NOW - timedelta(seconds=1),
            )
        ),
    ):
        quick = routes(reload_ms=300, **kw)
        assert hold_plan(quick, "upstream_unreachable", unreachable=True, now=T) is None, kw  # silence alone: no
        for code in ("model_lost", "model_warming"):  # lost, then restarting (loading again, attempt 2)
            plan = hold_plan(quick, code, unreachable=True, gone=M, now=T)
            assert plan is not None and "a reloads its lost models in place" in plan.why, (kw, code)
            assert plan.budget_ms == min(300 + backoff_max + MARGIN_MS, Policy().hold_max_ms)
        # the view a few events behind the agent: still resident there, but the agent said it is gone
        stale = _active_model(quick, Resident(since=NOW))
        assert hold_plan(stale, "model_lost", unreachable=True, gone=M, now=T).budget_ms == min(
            300 + backoff_max + MARGIN_MS, Policy().hold_max_ms
        )
        restarting = _active_model(quick, Loading(since=NOW, attempt=2))
        assert hold_plan(restarting, "model_warming", unreachable=True, gone=M, now=T) is not None
    # a reload nobody measured is not waited for: the answer goes at once, as before
    assert (
        hold_plan(routes(reload_ms=0, standby=Loading(since=NOW)), "model_lost", unreachable=True, gone=M, now=T)
        is None
    )


def test_a_gone_runtime_with_a_standby_ready_waits_for_whichever_serves_first():
    # b wakes in 400 ms; a reloads in 300 ms plus its restart backoff: the hold lasts the longer bound
    plan = hold_plan(routes(reload_ms=300), "model_lost", unreachable=True, gone=M, now=T)
    assert "auto-failover to b" in plan.why and "a reloading in place" in plan.why
    assert plan.budget_ms == min(
        max(5_000 + 400 + MARGIN_MS, 300 + Policy().restart_backoff_max_ms + MARGIN_MS), Policy().hold_max_ms
    )
    short = Policy(restart_backoff_max_ms=1_000)
    assert (
        hold_plan(routes(reload_ms=300, policy=short), "model_lost", unreachable=True, gone=M, now=T).budget_ms
        == short.heartbeat_timeout_ms + 400 + MARGIN_MS
    )
