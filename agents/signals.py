"""Seeing it coming: signs that this host or one of its GPUs is about to go, recorded as
`failure_signalled` on the agent subject so that the promoter moves the route off first.

    watcher = SignalWatcher(domain=..., gpus=open_signals("nvml"), notice=spec.preemption_notice,
                            record=..., logger=...)
    await watcher.run(gpu_indexes, errors)           # polls; each sign recorded once per agent life

The signs:

- `gpu_xid`: an NVML critical XID event (`nvmlEventTypeXidCriticalError`: a fallen-off-the-bus, a
  double-bit ECC, a GPU that stopped processing), read through an NVML event set without waiting;
- `gpu_ecc`: uncorrected (double-bit) volatile ECC errors above zero, or retired pages pending (the
  GPU needs a reset to retire them); an NVML that does not support a query says nothing, never a guess;
- `preemption_notice`: the domain's declared `preemption_notice`, polled every `interval_ms` in a loop
  of its own (a provider's long poll never delays the GPUs' checks): a provider's metadata service read
  with its own protocol (agents/notices.py: AWS, GCP, Azure), a URL, or a command.

The simulator's GPUs (agents/sim/gpu_state.py) carry the same signs in their state file (`haru sim
xid`, `haru sim ecc`), so the whole path runs without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp

from haru.agents.loops import LoopErrors, survive
from haru.agents.notices import provider_notices
from haru.core.events import FailureSignalled
from haru.core.specs import PreemptionNotice

__all__ = [
    "GpuSignals",
    "NvmlGpuSignals",
    "SimGpuSignals",
    "SignalWatcher",
    "notice_from_url",
    "notice_from_command",
    "open_signals",
]

_NOT_A_NOTICE = frozenset({"", "false", "none", "null", "0", "no"})
GPU_INTERVAL_S = 1.0


class GpuSignals(Protocol):
    """Critical signs on one GPU: (source, detail) pairs, `gpu_xid` or `gpu_ecc`; [] when none (or unknown)."""

    def critical(self, index: int) -> list[tuple[str, str]]: ...


def notice_from_url(status: int, body: str) -> str:
    """The notice a URL's answer gives ('' = none): a 200 whose body is not empty/false/none (pure)."""
    text = body.strip()
    if status != 200 or text.lower() in _NOT_A_NOTICE:
        return ""
    return text[:300]


def notice_from_command(returncode: int, stdout: str) -> str:
    """The notice a command's outcome gives ('' = none): exit 0 and something printed (pure)."""
    text = stdout.strip()
    if returncode != 0 or text.lower() in _NOT_A_NOTICE:
        return ""
    return text[:300]


class SimGpuSignals:
    """The simulated GPU's state file: `xid` (the last critical XID, 0 = none), `ecc_uncorrected`,
    `pages_pending` (written by `haru sim xid` / `haru sim ecc`)."""

    def __init__(self, sim_dir: str | os.PathLike[str]) -> None:
        self.sim_dir = sim_dir

    def critical(self, index: int) -> list[tuple[str, str]]:
        from haru.agents.sim.gpu_state import NoSimGpu, SimGpuState

        try:
            raw = SimGpuState(self.sim_dir, index).read()
        except NoSimGpu:
            return []
        return signs(int(raw.get("xid", 0)), int(raw.get("ecc_uncorrected", 0)), bool(raw.get("pages_pending", False)))


def signs(xid: int, ecc_uncorrected: int, pages_pending: bool) -> list[tuple[str, str]]:
    """What the counters say (pure)."""
    out = []
    if xid:
        out.append(("gpu_xid", f"critical XID {xid}"))
    if ecc_uncorrected > 0:
        out.append(("gpu_ecc", f"{ecc_uncorrected} uncorrected (double-bit) ECC errors"))
    if pages_pending:
        out.append(("gpu_ecc", "retired pages pending: the GPU needs a reset"))
    return out


class NvmlGpuSignals:
    """Real GPUs through NVML (pynvml). A query NVML does not support, or no NVML at all, says nothing."""

    def __init__(self) -> None:
        from haru.agents.gpu import _pynvml

        self._nvml = _pynvml()
        self._sets: dict[int, Any] = {}
        self.available = True
        try:
            self._nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no library, no driver: an honest nothing
            self.available = False

    def _event_set(self, index: int, handle: Any) -> Any:
        nvml = self._nvml
        if index not in self._sets:
            self._sets[index] = None
            with contextlib.suppress(Exception):
                event_set = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
                self._sets[index] = event_set
        return self._sets[index]

    def critical(self, index: int) -> list[tuple[str, str]]:
        if not self.available:
            return []
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - a GPU NVML cannot reach is the presence watcher's news
            return []
        xid = 0
        event_set = self._event_set(index, handle)
        if event_set is not None:
            with contextlib.suppress(Exception):  # NVML_ERROR_TIMEOUT: no event
                data = nvml.nvmlEventSetWait_v2(event_set, 0)
                xid = int(getattr(data, "eventData", 0) or 0)
        ecc = 0
        with contextlib.suppress(Exception):
            ecc = int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
        pending = False
        with contextlib.suppress(Exception):
            pending = bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        return signs(xid, ecc, pending)


class _NoSignals:
    def critical(self, index: int) -> list[tuple[str, str]]:
        return []


def open_signals(kind: str, sim_dir: str | os.PathLike[str] | None = None) -> GpuSignals:
    if kind == "sim" and sim_dir:
        return SimGpuSignals(sim_dir)
    if kind == "nvml":
        return NvmlGpuSignals()
    return _NoSignals()


class SignalWatcher:
    """Polls the GPUs' signs (every GPU_INTERVAL_S) and the preemption notice (every `interval_ms`);
    records each sign once in this agent's life with `record`."""

    def __init__(
        self,
        *,
        domain: str,
        gpus: GpuSignals,
        notice: PreemptionNotice | None,
        record: Callable[[FailureSignalled], Awaitable[None]],
        logger: Any,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.domain = domain
        self.gpus = gpus
        self.notice = notice
        self.record = record
        self.logger = logger
        self.session = session
        self.recorded: set[tuple[str, int]] = set()
        self.provider = provider_notices(notice) if notice is not None else None

    async def _signal(self, source: str, gpu_index: int, detail: str) -> None:
        key = (source, gpu_index)
        if key in self.recorded:
            return
        await self.record(
            FailureSignalled(
                at=datetime.now(UTC), domain=self.domain, source=source, gpu_index=gpu_index, detail=detail
            )
        )
        self.recorded.add(key)
        self.logger.warning(
            "failure signalled: the route moves off this domain", source=source, gpu=gpu_index, detail=detail
        )

    async def check_gpus(self, indexes: Iterable[int]) -> None:
        for index in indexes:
            for source, detail in await asyncio.to_thread(self.gpus.critical, index):
                await self._signal(source, index, f"GPU {index}: {detail}")

    async def check_notice(self) -> None:
        if self.notice is not None and ("preemption_notice", -1) not in self.recorded:
            said = await self.poll_notice(self.notice)
            if said:
                await self._signal("preemption_notice", -1, said)

    async def poll_notice(self, notice: PreemptionNotice) -> str:
        timeout = max(0.1, min(2.0, notice.interval_ms / 1000))
        if self.provider is not None or notice.url:
            session = self.session
            if session is None:
                return ""
            try:
                if self.provider is not None:
                    return await self.provider.poll(session, wait_s=notice.interval_ms / 1000)
                async with session.get(
                    notice.url, headers=notice.headers, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as r:
                    return notice_from_url(r.status, await r.text(errors="replace"))
            except (aiohttp.ClientError, TimeoutError):
                return ""  # the endpoint not answering is not a notice
        proc = await asyncio.create_subprocess_exec(
            *notice.command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return ""
        return notice_from_command(proc.returncode or 0, out.decode(errors="replace"))

    async def run(self, indexes: Callable[[], Iterable[int]], errors: LoopErrors) -> None:
        async def gpus() -> None:
            while True:
                await survive(lambda: self.check_gpus(indexes()), name="signals", errors=errors, logger=self.logger)
                await asyncio.sleep(GPU_INTERVAL_S)

        async def notice(interval_s: float) -> None:
            while True:
                started = time.monotonic()
                await survive(self.check_notice, name="preemption-notice", errors=errors, logger=self.logger)
                # a long poll (GCP) already waited; a plain read waits out the rest of the interval
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

        loops = [gpus()]
        if self.notice is not None:
            loops.append(notice(self.notice.interval_ms / 1000))
        await asyncio.gather(*loops)
