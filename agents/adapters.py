"""LoRA adapters loaded into this host's runtimes at run time (docs/adapters.md).

The fleet view (`FleetView.adapters`, folded from `adapter_published` and the promoter's `adapter_routed`)
says which versions of each adapter a runtime of its base model should hold (`haru.core.adapters.wanted`);
this unit makes each of this host's vLLM runtimes that declares `max_loras` hold exactly those:

    fetch    the version's object from the haru_adapters object store, checked by its digest, unpacked
             under <state_dir>/adapters/<digest>/ (once per digest)
    admit    at most `max_loras` versions per runtime, each of rank <= `max_lora_rank`, in the order `wanted`
             gives (current, canary, the one waiting for its probe, previous); the rest `not_admitted`
    load     POST /v1/load_lora_adapter under `<base>:<adapter>@<version>`, then a greedy fixed-seed answer
             from it: `resident` only once it answered
    unload   POST /v1/unload_lora_adapter for what is no longer wanted (a rolled-back canary): `unloaded`

Each step is an `adapter_state_changed` on the base model's residency subject (which only this agent writes),
with the runtime's own words when it refused. It runs on every change of the view and every `RECHECK_S`
(which is also how soon it notices a model that a live apply gave `max_loras`),
so a runtime that restarted or slept at level 2 (vLLM drops its adapters) gets them back; the wake path asks
`restore` first, so a wake is proven with every adapter's own answer (agents/sleep_wake.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from haru.agents.adapter_files import fetch
from haru.agents.appender import Append
from haru.agents.errors import RuntimeProblem
from haru.agents.model_slot import ModelSlot
from haru.core import subjects
from haru.core.adapters import AdapterVersion, AdapterView, runtime_name, split_runtime_name, wanted
from haru.core.events import AdapterStateChanged
from haru.core.specs import Policy
from haru.core.views import FleetView, view_decoder
from haru.log.seam import Log
from haru.log.training_objects import Objects

__all__ = ["Adapters", "Want", "plan"]

RECHECK_S = 2.0
HTTP_TIMEOUT_S = 60.0


class Want(msgspec.Struct, frozen=True):
    """One version a runtime should hold, or why it may not."""

    adapter: str
    version: AdapterVersion
    name: str  # its runtime name
    refused: str = ""  # '' = admitted; else why not (not_admitted)


def plan(spec_name: str, max_loras: int, max_rank: int, adapters: list[AdapterView]) -> list[Want]:
    """What one runtime of base model `spec_name` should hold (pure): every wanted version of each adapter,
    most important first across adapters (all current versions, then canaries, ...), admitted while the
    runtime has slots (`max_loras`) and the rank fits (`max_rank`)."""
    rounds: list[list[tuple[AdapterView, str]]] = []
    for av in adapters:
        for i, v in enumerate(wanted(av)):
            while len(rounds) <= i:
                rounds.append([])
            rounds[i].append((av, v))
    out: list[Want] = []
    used = 0
    for group in rounds:
        for av, v in group:
            version = av.versions[v]
            name = runtime_name(spec_name, av.adapter, v)
            if version.rank > max_rank:
                why = f"rank {version.rank} is over the model's max_lora_rank {max_rank} (vLLM's --max-lora-rank)"
            elif used >= max_loras:
                why = f"the runtime holds max_loras {max_loras} adapter versions already (vLLM's --max-loras)"
            else:
                why = ""
                used += 1
            out.append(Want(av.adapter, version, name, why))
    return out


class Adapters:
    def __init__(
        self,
        *,
        fleet: str,
        domain: str,
        log: Log,
        objects: Objects,
        models: dict[str, ModelSlot],
        append: Append,
        session: aiohttp.ClientSession,
        store_dir: Path,
        policy: Callable[[], Policy],
        stopping: Callable[[], bool],
        logger: Any,
    ) -> None:
        self.fleet, self.domain, self.log, self.models = fleet, domain, log, models
        self.append, self.session, self.store_dir = append, session, store_dir
        self.policy, self.stopping, self.logger = policy, stopping, logger
        self.objects = objects
        self.view: FleetView | None = None
        self.changed = asyncio.Event()
        self.said: dict[tuple[str, str], tuple[str, str]] = {}  # (model, runtime name) -> last (state, detail)
        self.failed: dict[tuple[str, str], int] = {}  # (model, runtime name) -> the runtime generation it failed on

    def probe_timeout_s(self) -> float:
        return self.policy().probe_timeout_ms / 1000

    # ------------------------------------------------------------------------------ following the view

    async def run(self) -> None:
        """Follow the fleet's view and keep every runtime holding what it says, until the agent stops. The view
        is watched from the first model that declares `max_loras`, whether the agent started with it or a live
        apply added it (agents/live_apply.py replaces that model: its runtime restarts with --enable-lora)."""
        watch: asyncio.Future[None] | None = None
        try:
            while not self.stopping():
                if watch is None and any(m.spec.max_loras for m in list(self.models.values())):
                    watch = asyncio.ensure_future(self._watch())
                try:
                    await asyncio.wait_for(self.changed.wait(), RECHECK_S)
                except TimeoutError:
                    pass
                self.changed.clear()
                for m in list(self.models.values()):
                    if m.spec.max_loras and self.view is not None:
                        try:
                            await self.reconcile(m)
                        except asyncio.CancelledError:
                            raise
                        except Exception:
                            self.logger.exception("adapters: reconciling failed", model=m.name)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    async def _watch(self) -> None:
        key = subjects.view_key(self.fleet)
        last: object = None
        while not self.stopping():
            try:
                async for _key, value, _rev in self.log.watch_views(key):
                    if value is None:
                        continue
                    view = view_decoder.decode(value)
                    self.view = view
                    mark = [(k, wanted(av), av.rolled_back) for k, av in view.adapters.items()]
                    if mark != last:
                        last = mark
                        self.changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.logger.warning("adapters: the view watch stopped; watching again", error=str(exc))
                await asyncio.sleep(1.0)

    # ----------------------------------------------------------------------------------- one runtime

    def plan_for(self, m: ModelSlot) -> list[Want]:
        view = self.view
        if view is None:
            return []
        avs = [av for av in view.adapters.values() if av.model == m.name]
        return plan(m.name, m.spec.max_loras, m.spec.max_lora_rank, avs)

    async def reconcile(self, m: ModelSlot) -> None:
        """Make `m`'s runtime hold what the view wants (only while resident: a sleeping or loading runtime is
        asked again once it answers)."""
        if m.state_tag != "resident":
            return
        async with m.lock:
            if m.state_tag == "resident":
                await self.restore(m)

    async def restore(self, m: ModelSlot) -> list[str]:
        """Load what `m`'s runtime should hold and does not, unload what it should not (caller holds m.lock).
        Returns the runtime names it holds afterwards (what a wake check asks)."""
        wants = self.plan_for(m)
        try:
            held = {n for n in await m.runtime.list_models(self.probe_timeout_s()) if split_runtime_name(n)}
        except RuntimeProblem as exc:
            self.logger.warning("adapters: cannot list the runtime's models", model=m.name, error=str(exc))
            return sorted(m.runtime_adapters)
        keep = {w.name for w in wants if not w.refused}
        for name in sorted(held - keep):
            await self._unload(m, name)
        for w in wants:
            if w.refused:
                await self._say(m, w, "not_admitted", w.refused)
            elif w.name not in held:
                if self.failed.get((m.name, w.name)) != m.generation:  # a failure is not retried on one runtime
                    await self._load(m, w)
            else:
                m.runtime_adapters[w.name] = str(self._dir(w.version))
                if self.said.get((m.name, w.name), ("",))[0] != "resident":  # held, but not known here (a restart)
                    probe, probe_detail = await self._evaluate(m, w)
                    await self._say(m, w, "resident", "found loaded", probe=probe, probe_detail=probe_detail)
        return sorted(m.runtime_adapters)

    def _dir(self, v: AdapterVersion) -> Path:
        return self.store_dir / v.digest.replace(":", "-")

    async def _fetch(self, v: AdapterVersion) -> Path:
        return await fetch(self.objects, v.object_name, v.digest, self._dir(v))

    async def _load(self, m: ModelSlot, w: Want) -> None:
        started = time.monotonic()
        try:
            path = await self._fetch(w.version)
        except Exception as exc:
            await self._say(m, w, "failed", f"fetching {w.version.object_name}: {exc}")
            return
        await self._say(m, w, "loading", "")
        status, text = await self._post(m, "/v1/load_lora_adapter", {"lora_name": w.name, "lora_path": str(path)})
        if status != 200 and "already been loaded" not in text:
            await self._say(m, w, "failed", f"the runtime answered {status}: {text}")
            return
        try:
            await m.runtime.greedy_answer(w.name, self.probe_timeout_s())
        except RuntimeProblem as exc:
            await self._say(m, w, "failed", f"loaded but did not answer: {exc}")
            return
        took = int((time.monotonic() - started) * 1000)
        m.runtime_adapters[w.name] = str(path)
        probe, probe_detail = await self._evaluate(m, w)
        await self._say(m, w, "resident", "", took_ms=took, probe=probe, probe_detail=probe_detail)

    async def _evaluate(self, m: ModelSlot, w: Want) -> tuple[str, str]:
        """The adapter's evaluation probe (the layout's `adapter_probes`): each prompt's greedy, fixed-seed
        answer must contain what the operator expects. ('', '') when none is declared."""
        cases = m.spec.adapter_probes.get(w.adapter, [])
        if not cases:
            return "", ""
        said: list[str] = []
        for case in cases:
            body = {
                "model": w.name,
                "prompt": case.prompt,
                "max_tokens": case.max_tokens,
                "temperature": 0,
                "seed": 0,
            }
            status, text = await self._post(m, "/v1/completions", body)
            answer = ""
            if status == 200:
                try:
                    answer = str(msgspec.json.decode(text.encode())["choices"][0]["text"])
                except (msgspec.DecodeError, KeyError, IndexError, TypeError):
                    answer = ""
            if status != 200 or case.expect not in answer:
                got = repr(answer) if status == 200 else f"HTTP {status}: {text[:200]}"
                return "failed", f"prompt {case.prompt!r} expected {case.expect!r}, answered {got}"
            said.append(f"{case.prompt!r} -> {answer!r}")
        return "passed", "; ".join(said)[:500]

    async def _unload(self, m: ModelSlot, name: str) -> None:
        status, text = await self._post(m, "/v1/unload_lora_adapter", {"lora_name": name})
        m.runtime_adapters.pop(name, None)
        served_version = split_runtime_name(name)
        if served_version is None:
            return
        served, version = served_version
        adapter = served[len(m.name) + 1 :] if served.startswith(m.name + ":") else served
        detail = "" if status == 200 else f"the runtime answered {status}: {text}"
        await self._record(m, adapter, version, name, "unloaded", detail, 0)

    async def _post(self, m: ModelSlot, path: str, body: dict[str, Any]) -> tuple[int, str]:
        try:
            async with self.session.post(
                m.runtime.base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
            ) as r:
                return r.status, (await r.text())[:4000]
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, f"no answer: {exc}"

    async def _say(
        self, m: ModelSlot, w: Want, state: str, detail: str, took_ms: int = 0, probe: str = "", probe_detail: str = ""
    ) -> None:
        await self._record(
            m, w.adapter, w.version.version, w.name, state, detail, took_ms, probe, probe_detail, w.version.seq
        )

    async def _record(
        self,
        m: ModelSlot,
        adapter: str,
        version: str,
        name: str,
        state: str,
        detail: str,
        took_ms: int,
        probe: str = "",
        probe_detail: str = "",
        cause: int = 0,
    ) -> None:
        if state == "failed":
            self.failed[(m.name, name)] = m.generation
        last = self.said.get((m.name, name))
        if last is not None and last[0] == state and (state != "resident" or not took_ms):
            return  # no news (a resident version seen again; a refusal said once)
        self.said[(m.name, name)] = (state, detail)
        event = AdapterStateChanged(
            at=datetime.now(UTC),
            domain=self.domain,
            model=m.name,
            adapter=adapter,
            version=version,
            state=state,  # type: ignore[arg-type]
            detail=detail[:500],
            runtime_name=name,
            took_ms=took_ms,
            probe=probe,
            probe_detail=probe_detail[:500],
            cause=cause,  # its publication: the run that produced it (`haru why <base>:<adapter>`)
        )
        async with m.append_lock:
            m.seq = await self.append(m.subject, event, m.seq)
        self.logger.info("adapter_" + state, model=m.name, adapter=name, detail=detail, took_ms=took_ms)
