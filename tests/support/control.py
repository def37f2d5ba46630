"""The control API's test world: a fleet `ops` of two echo upstreams (a and b), and a call into a gateway."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from haru.core.layout import parse_layout
from haru.gateway import Gateway

MODEL = "qwen3.6:27b"


def layout(url_a: str, url_b: str):
    def domain(name: str, url: str) -> dict:
        return {
            "name": name,
            "serving_url": url,
            "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}],
            "slots": [{"name": "chat", "gpu": 0, "models": [{"name": MODEL, "vram": "10GiB", "port": 18100}]}],
        }

    return parse_layout({"fleet": "ops", "domains": [domain("a", url_a), domain("b", url_b)]})


async def echo_upstream(domain: str):
    async def handle(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"message": {"content": f"[domain {domain}]"}}]})

    runner = web.ServerRunner(web.Server(handle), handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def call(gw: Gateway, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, gw.url + path, data=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)
