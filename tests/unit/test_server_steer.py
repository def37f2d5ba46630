"""Where an agent's reconnect goes (haru.log.eventlog.ServerSteer): round the servers in the order given,
or to the one asked for."""

from __future__ import annotations

from urllib.parse import urlparse

from nats.aio.client import Server

from haru.log.eventlog import ServerSteer

URLS = ["nats://127.0.0.1:4222", "nats://10.0.0.1:17012", "nats://10.0.0.1:17013"]


def pool(*urls: str) -> list[Server]:
    return [Server(uri=urlparse(u)) for u in urls]


def test_reconnects_go_round_the_servers_in_the_order_given_waiting_before_each_new_round():
    steer = ServerSteer(URLS, wait_s=0.5)
    got = [steer(pool(*URLS), {}) for _ in range(4)]
    assert [(s.uri.geturl(), wait) for s, wait in got] == [
        (URLS[1], 0.0),
        (URLS[2], 0.0),
        (URLS[0], 0.5),
        (URLS[1], 0.0),
    ]


def test_the_server_asked_for_goes_first_then_the_round_continues_after_it():
    steer = ServerSteer(URLS, wait_s=0.5)
    steer.go(URLS[0])
    first, wait = steer(pool(*URLS), {})
    assert first.uri.geturl() == URLS[0] and wait == 0.0
    assert steer(pool(*URLS), {})[0].uri.geturl() == URLS[1]


def test_a_server_no_longer_in_the_pool_is_passed_over():
    steer = ServerSteer(URLS, wait_s=0.5)
    steer.go("nats://10.9.9.9:4222")
    assert steer(pool(URLS[0], URLS[2]), {})[0].uri.geturl() == URLS[2]
