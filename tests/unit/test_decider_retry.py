"""An aborted automatic failover whose active is still unfit is retried promptly, with a bounded backoff."""

from __future__ import annotations

from haru.core.events import FailoverDeclined, OperationAborted, PromotionRequested
from haru.core.fold import evolve
from haru.promoter.failover import failover_retry_ms, retry_ms
from tests.support.decider import OP, POLICY, at, facts, given, healthy_fleet, only, unreachable


def auto(op_id: str, ms: int, attempt: int = 1):
    return (
        OP,
        PromotionRequested(
            at=at(ms), op_id=op_id, target="b", source="a", reason="domain_unreachable", attempt=attempt
        ),
    )


def aborted(op_id: str, ms: int, error: str = "GPU 0 has 2 GiB free; its sleeping models need 8 GiB to wake"):
    return (OP, OperationAborted(at=at(ms), op_id=op_id, step="verify_gpu", error=error))


SILENT = {"a": 3000, "b": 100}


def test_the_backoff_doubles_from_the_policy_and_is_capped():
    assert [failover_retry_ms(POLICY, n) for n in (1, 2, 3, 4, 5, 6, 7)] == [500, 1000, 2000, 4000, 8000, 8000, 8000]
    assert failover_retry_ms(POLICY, 1) < retry_ms(POLICY)  # not after a minute (here 5 s)


def test_an_aborted_automatic_failover_is_retried_after_the_short_backoff_each_attempt_recorded():
    view = given(*healthy_fleet(), unreachable("a", 5), auto("op-1", 10), aborted("op-1", 20))
    assert only(view, facts(ms=20 + 499, silent_ms=SILENT)) is None  # within the backoff: nothing yet
    again = only(view, facts(ms=20 + 500, silent_ms=SILENT))
    assert isinstance(again, PromotionRequested) and again.attempt == 2 and again.reason == "domain_unreachable"
    # the second attempt aborts too: the third waits twice as long
    view = given(
        *healthy_fleet(),
        unreachable("a", 5),
        auto("op-1", 10),
        aborted("op-1", 20),
        auto("op-2", 520, 2),
        aborted("op-2", 600),
    )
    assert only(view, facts(ms=600 + 999, silent_ms=SILENT)) is None
    third = only(view, facts(ms=600 + 1000, silent_ms=SILENT))
    assert isinstance(third, PromotionRequested) and third.attempt == 3


def test_past_the_cap_it_gives_up_says_why_once_and_falls_back_to_the_usual_backoff():
    cap = POLICY.failover_retry_attempts
    view = given(
        *healthy_fleet(), unreachable("a", 5), auto("op-5", 10, cap), aborted("op-5", 20, "wake: out of memory")
    )
    declined = only(view, facts(ms=20 + 100, silent_ms=SILENT))
    assert isinstance(declined, FailoverDeclined)
    assert f"gave up retrying the failover onto b after {cap} attempts" in declined.why
    assert "wake: out of memory" in declined.why and f"next try after {retry_ms(POLICY)} ms" in declined.why
    view = evolve(view, declined, seq=view.seq + 1, subject=OP)
    assert only(view, facts(ms=20 + 200, silent_ms=SILENT)) is None  # said once
    later = only(view, facts(ms=20 + retry_ms(POLICY), silent_ms=SILENT))
    assert isinstance(later, PromotionRequested) and later.attempt == 1  # a fresh series


def test_a_healthy_active_is_not_failed_over_again_after_an_abort():
    view = given(*healthy_fleet(), auto("op-1", 10), aborted("op-1", 20))
    assert not isinstance(only(view, facts(ms=20 + 600)), PromotionRequested)
