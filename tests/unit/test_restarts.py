"""The restart policy of `haru up`: backoff doubling to a cap, forgiven after a stable run, a crash
loop from the third quick death in a row."""

from __future__ import annotations

import signal

from haru.core.restarts import RestartPolicy, exit_reason, next_restart

POLICY = RestartPolicy(first_s=0.5, max_s=4.0, stable_s=30.0, loop_after=3)


def test_quick_deaths_double_the_delay_up_to_the_cap_and_become_a_crash_loop():
    failures, seen = 0, []
    for _ in range(6):
        failures, delay, looping = next_restart(POLICY, failures, ran_s=1.0)
        seen.append((failures, delay, looping))
    assert seen == [(1, 0.5, False), (2, 1.0, False), (3, 2.0, True), (4, 4.0, True), (5, 4.0, True), (6, 4.0, True)]


def test_a_stable_run_forgives_earlier_failures():
    failures, delay, looping = next_restart(POLICY, 5, ran_s=30.0)
    assert (failures, delay, looping) == (1, 0.5, False)


def test_exit_reasons_in_words():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(3) == "exited with status 3"
    assert exit_reason(0) == "exited with status 0"
    assert exit_reason(None) == "still running"


def test_backoff_doubles_per_failure_in_a_row_and_is_capped():
    from haru.core.restarts import Backoff

    b = Backoff(first_s=0.25, max_s=5.0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.delay(0) == 0.25 and b.delay(10_000) == 5.0  # no overflow after a long outage
