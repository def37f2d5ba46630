"""The agent's serving port resends a request whose kept-alive connection the runtime had closed, once,
on a new connection: never on the next idle one, which the runtime closed too (llama-server closes
every connection idle for 5 s; a route that comes back to a domain finds its whole pool stale)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from haru.agents.serving import ServingProxy
from haru.agents.serving_env import ServingEnv
from tests.support.gateway import OK_JSON, RawUpstream

pytestmark = pytest.mark.timeout(30)


async def _proxy(tmp_path) -> ServingProxy:
    slots = SimpleNamespace(fleet="f", domain="a", models={})
    proxy = ServingProxy(
        slots,
        None,
        policy=lambda: None,
        keep_runtimes=lambda: False,
        role=SimpleNamespace(now="active"),
        state_dir=tmp_path,
        host="127.0.0.1",
        port=0,
        env=ServingEnv(),
    )
    # what start() makes, without the port holder: the two client sessions
    proxy._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    proxy._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    return proxy


def _request():
    """A client's request whose connection is open (the resend is only for a client still waiting)."""
    return make_mocked_request("POST", "/v1/chat/completions", transport=mock.Mock(is_closing=lambda: False))


async def test_the_resend_of_a_closed_kept_alive_connection_never_takes_another_idle_one(tmp_path):
    # each connection answers its first request and closes on its second without a byte
    up = await RawUpstream(lambda n: OK_JSON if n == 1 else None).start()
    proxy = await _proxy(tmp_path)
    model = SimpleNamespace(name="m1")
    url = up.url + "/v1/chat/completions"
    body = b'{"model": "m1"}'
    try:
        first = await asyncio.gather(*(proxy._forward(_request(), model, url, body) for _ in range(3)))
        assert [r.status for r in first] == [200] * 3 and up.connections == 3  # three idle in the pool now
        again = await proxy._forward(_request(), model, url, body)
        assert (again.status, again.body) == (200, b'{"ok":true}')
        assert up.connections == 4  # the resend opened its own
    finally:
        await proxy._close_sessions()
        await up.stop()
