"""vLLM: `vllm serve <source> --host 127.0.0.1 --port P --served-model-name NAME
--gpu-memory-utilization F --max-model-len N --enable-sleep-mode`, its command line the plan's
(`haru.core.launch`: F is the model's planned VRAM over the GPU's memory, rounded down).

The sleep/wake endpoints are development-mode endpoints, so the child gets VLLM_SERVER_DEV_MODE=1.
`POST /sleep?level=1` and `POST /wake_up` answer a bare 200 that proves nothing: both are checked
against `GET /is_sleeping` (and the agent probes after a wake). A wake that fails because someone
else holds the VRAM answers 500 "CUDA Error: out of memory": that is `OutOfMemory`, never success.
"""

from __future__ import annotations

from agents.errors import Unverified
from agents.runtimes.base import ProcessRuntime


class VllmRuntime(ProcessRuntime):
    kind = "vllm"
    can_sleep = True
    default_binary = ["vllm"]

    async def sleep(self, level: int, timeout_s: float) -> None:
        status, body = await self._request("POST", f"/sleep?level={int(level)}", timeout_s=timeout_s)
        if status != 200:
            self._raise_for(self.spec.name, f"POST /sleep?level={level}", status, body)
        if await self.is_sleeping() is not True:
            raise Unverified(f"{self.spec.name}: /sleep answered 200 but /is_sleeping says it is awake")

    async def wake(self, timeout_s: float) -> None:
        status, body = await self._request("POST", "/wake_up", timeout_s=timeout_s)
        if status != 200:
            self._raise_for(self.spec.name, "POST /wake_up", status, body)
        if await self.is_sleeping() is not False:
            raise Unverified(f"{self.spec.name}: /wake_up answered 200 but /is_sleeping says it still sleeps")
