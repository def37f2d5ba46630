"""An already-running OpenAI-compatible endpoint (`ModelSpec.url`): probed, never spawned or stopped.

Its health is `/v1/models` listing the model (an OpenAI-compatible server need not have `/health`).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from haru.agents.errors import RuntimeProblem
from haru.agents.runtimes.base import Health, HttpRuntime
from haru.core.specs import ModelSpec


class ExternalRuntime(HttpRuntime):
    kind = "external"
    can_sleep = False

    def __init__(self, spec: ModelSpec, *, session: aiohttp.ClientSession) -> None:
        super().__init__(spec, session=session)
        url = spec.url or (f"http://127.0.0.1:{spec.port}" if spec.port else "")
        self._url = url.rstrip("/")
        if self._url.endswith("/v1"):
            self._url = self._url[: -len("/v1")]
        parts = urlsplit(self._url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def base_url(self) -> str:
        return self._url

    async def start(self) -> None:
        pass

    async def wait_exit(self) -> int | None:
        await asyncio.Future()  # not ours: it never "exits" from where we stand
        return None

    async def stop(self, grace_s: float) -> int | None:
        return None

    async def health(self, timeout_s: float = 5.0) -> Health:
        try:
            models = await self.list_models(timeout_s)
        except RuntimeProblem as exc:
            return Health(ok=False, detail=str(exc))
        return Health(ok=True, status=200, detail="" if self.spec.name in models else "model not listed")
