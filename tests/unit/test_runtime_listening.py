"""A loading runtime's port is watched with a bare connect (agents/runtimes/base.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from haru.agents.runtimes.base import ProcessRuntime
from haru.core.specs import ModelSpec
from tests.support.ports import lasting_port


async def test_a_port_listens_only_once_something_accepts_on_it(tmp_path: Path):
    port = lasting_port()
    async with aiohttp.ClientSession() as session:
        rt = ProcessRuntime(
            ModelSpec(name="m", slot="s", gpu_index=0, runtime="vllm", vram_bytes=1, port=port),
            session=session,
            log_dir=tmp_path,
        )
        assert await rt.listening() is False  # nothing there
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        try:
            assert await rt.listening() is True
        finally:
            server.close()
            await server.wait_closed()
        assert await rt.listening() is False
