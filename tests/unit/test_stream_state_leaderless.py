"""A stream's state is read as its leader answers it (haru/log/jetstream.py `stream_state`).

JetStream lets a replica that knows no leader for its group answer STREAM.INFO with its own copy's state,
and the first answer wins. Right after a partition heals, the replica that was cut off is such a replica:
it says the stream ends where its copy ends. Taken as the stream's head, that reads as the log gone back
(a follower folds everything again and a promoter restores a route it believes forgotten)."""

from __future__ import annotations

import pytest
from nats.js import api

from haru.core.errors import LogUnavailable
from haru.log.jetstream import stream_state

pytestmark = pytest.mark.timeout(10)


def info(last_seq: int, leader: str | None, clustered: bool = True) -> api.StreamInfo:
    return api.StreamInfo.from_response(
        {
            "config": {"name": "HARU_EVENTS"},
            "state": {"messages": last_seq, "bytes": 0, "first_seq": 1, "last_seq": last_seq, "consumer_count": 0},
            **({"cluster": {"name": "haru", "leader": leader}} if clustered else {}),
        }
    )


class _Js:
    def __init__(self, *answers: api.StreamInfo) -> None:
        self.answers = list(answers)
        self.asked = 0

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> api.StreamInfo:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def test_a_replica_that_knows_no_leader_is_asked_past_for_the_leaders_answer():
    js = _Js(info(205, ""), info(349, "haru-nats-r2"))
    got = await stream_state(js, "HARU_EVENTS")
    assert got.state.last_seq == 349 and js.asked == 2


async def test_only_leaderless_answers_for_a_while_is_unavailable_not_a_shorter_stream():
    js = _Js(info(205, ""))
    with pytest.raises(LogUnavailable, match="knows no leader for it"):
        await stream_state(js, "HARU_EVENTS", within_s=0.5)
    assert js.asked >= 2


async def test_a_single_server_has_no_cluster_part_and_is_its_own_answer():
    js = _Js(info(7, None, clustered=False))
    assert (await stream_state(js, "HARU_EVENTS")).state.last_seq == 7
