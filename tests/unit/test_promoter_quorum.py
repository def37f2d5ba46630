"""A promoter whose appends reach no majority says so: the named state `minority` (haru/promoter/quorum.py)."""

from __future__ import annotations

import structlog

from haru.core.errors import LogError, LogUnavailable
from haru.promoter.liveness import judge_liveness
from haru.promoter.quorum import RECHECK_S, Isolation, Quorum, most_heard_ago, no_quorum, reaches_most
from tests.support.decider import at, given, healthy_fleet


def test_only_failures_no_majority_answered_count_as_minority():
    assert no_quorum(LogUnavailable("appending to x: no stream leader answered in time"))
    assert no_quorum(LogError("appending: JetStream refused: JetStream system temporarily unavailable (code 10008)"))
    assert not no_quorum(LogError("appending: JetStream refused: maximum payload exceeded (code 10054)"))


def test_minority_is_entered_once_and_left_when_a_quorum_answers():
    with structlog.testing.capture_logs() as logs:
        q = Quorum(structlog.get_logger("test"))
        assert q.state == "majority" and not q.answered()
        assert q.failed(LogUnavailable("timed out waiting for NATS"))
        assert q.state == "minority"
        assert not q.failed(LogUnavailable("timed out waiting for NATS"))  # said once, not per retry
        assert q.answered()
        assert q.state == "majority" and q.entered == 1
    assert [e["event"] for e in logs] == ["quorum_lost", "quorum_regained"]
    assert logs[0]["state"] == "minority"


def test_a_refusal_for_another_reason_leaves_the_state_alone():
    q = Quorum(structlog.get_logger("test"))
    assert not q.failed(LogError("appending: JetStream refused: maximum payload exceeded (code 10054)"))
    assert q.state == "majority"


def test_a_record_committed_after_entering_minority_ends_it_and_one_from_before_does_not():
    q = Quorum(structlog.get_logger("test"))
    q.failed(LogUnavailable("timed out waiting for NATS"))
    assert not q.committed(q.entered_ns - 1)  # stored before we were cut off: proves nothing
    assert q.state == "minority"
    assert q.committed(q.entered_ns + 1)
    assert q.state == "majority"


def test_a_promoter_hearing_most_of_the_promoters_it_knows_is_on_the_majoritys_side():
    assert reaches_most(heard=2, known=3)  # a lost region's promoter is missed; ours and one more are heard
    assert reaches_most(heard=3, known=3)
    assert not reaches_most(heard=1, known=3)  # only itself: it may be the one cut off
    assert not reaches_most(heard=2, known=4)  # half is not most
    assert not reaches_most(heard=2, known=2)  # too few known to tell a cut from an election
    assert not reaches_most(heard=1, known=1)


def test_an_episode_while_most_promoters_are_heard_keeps_what_was_heard_unless_they_fall_silent():
    q = Quorum(structlog.get_logger("test"))
    assert q.failed(LogUnavailable("appending: no stream leader answered in time"), heard_most=True)
    assert q.state == "minority" and not q.cut_off  # a stream electing its leader: silence stays evidence
    q.alone()  # then the other promoters fall silent too: this may be our own isolation after all
    assert q.cut_off
    assert q.answered() and q.cut_off  # the episode ends as one whose silence is measured afresh

    q2 = Quorum(structlog.get_logger("test"))
    assert q2.failed(LogUnavailable("timed out waiting for NATS"))  # not told: assumed cut off
    assert q2.cut_off


def test_a_promoter_that_stops_hearing_most_promoters_is_cut_off_until_it_hears_most_of_those_again():
    iso = Isolation()
    assert iso.judge(heard=2, known=2, now=0) == ""  # fewer than three known: it cannot tell
    assert iso.judge(heard=3, known=3, now=1) == ""
    assert iso.judge(heard=1, known=3, now=2) == "cut"  # alone of three: no verdict of silence from here
    # the others fade from what it knows while it is cut off: that must not end the episode
    assert iso.judge(heard=1, known=1, now=3) == "still"
    assert iso.judge(heard=2, known=2, now=4) == "back"  # most of the three known at the cut: measure afresh
    assert iso.judge(heard=2, known=2, now=5) == ""


def test_an_episode_with_the_others_never_heard_again_lapses_they_may_be_gone():
    iso = Isolation()
    assert iso.judge(heard=1, known=3, now=0) == "cut"
    assert iso.judge(heard=1, known=1, now=RECHECK_S) == "still"
    assert iso.judge(heard=1, known=1, now=RECHECK_S + 1) == "lapsed"
    assert iso.judge(heard=1, known=1, now=RECHECK_S + 2) == ""  # whom it knew was forgotten with the lapse


def test_most_heard_is_the_age_of_the_promoter_that_makes_a_majority():
    assert most_heard_ago([0.0, 0.4, 7.5]) == 0.4  # itself now, one peer 0.4 s ago, one silent: 2 of 3
    assert most_heard_ago([0.0, 4.2, 4.3]) == 4.2  # cut off 4.2 s ago: most were last heard then
    assert most_heard_ago([0.1, 0.2, 9.0, 9.5, 0.3]) == 0.3  # 3 of 5
    assert most_heard_ago([0.0, 0.1]) is None  # two known: it cannot tell


def test_silence_measured_after_most_promoters_were_last_heard_is_no_verdict():
    """The cut-off side's race: a promoter cut off with its region stops hearing the active and its peers at
    once, and may reach the heartbeat timeout before it finds the peers silent. Its verdict, appended after
    the heal, failed over a fleet whose active had served throughout (the region tests saw it)."""
    view = given(*healthy_fleet())  # heartbeat_timeout_ms 1000 (tests/support/decider.py)
    silent = {"a": 1100, "b": 1100}

    def verdicts(most_heard_ms):
        return [a.event.domain for a in judge_liveness(view, silent, 60_000, at(5), most_heard_ms=most_heard_ms)]

    assert verdicts(None) == ["a", "b"]  # fewer than three promoters known: silence is judged as measured
    assert verdicts(50) == ["a", "b"]  # most promoters heard 50 ms ago: 1050 ms of silence vouched for
    assert verdicts(900) == []  # cut off 900 ms ago: only 200 ms of the silence was heard with the others
    never = judge_liveness(view, {"a": None, "b": 1100}, 1100, at(5), most_heard_ms=900)
    assert never == []  # never heard: the listening counts the same way
