"""One cold load at a time per GPU, in declaration order: the agent's load queue.

vLLM sizes its KV cache from the GPU memory it measures while it starts (it loads the weights, runs a
profiling pass, and gives the cache what is left of its `--gpu-memory-utilization` share). A second
instance that allocates, or a neighbour that frees, on the same GPU during that window makes the
first one mis-size its cache or fail ("No available memory for the cache blocks"; "Error in memory
profiling ... other processes sharing the same container release GPU memory while vLLM is
profiling"). So the host loads one model at a time per GPU: at boot, after a crash, on a layout
applied live and on a standby's reload alike, and in declaration order (the planner's priority
order) among the models that want to load at the same moment. Wakes are not gated (a level-1 wake
copies weights back into memory the runtime reserved itself; a failover must not queue behind a cold
load); see docs/residency.md.

A model spanning several GPUs (tensor parallel) takes its turn on all of them at once.

    LoadQueue(order)                 order(): the model names in declaration order, as now declared
    queue.enroll(name, gpus)         a supervisor exists for `name`: it will ask for a turn (arriving)
    await queue.acquire(name, on_wait)   wait for the turn; `on_wait(text)` is called once if it must wait
    queue.release(name)              the load (and a standby's sleep after it) is over, or it stands aside
    queue.withdraw(name)             the supervisor is gone

The rule is pure (`grants`, `waits_for`): an entry that is `waiting` may load when none of its GPUs
is held by a `loading` entry, and no entry before it in declaration order that shares one of its GPUs
is `waiting` or `arriving` (enrolled, not yet asked: at boot every supervisor starts at once, and the
first declared must not lose the race to the third).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import msgspec

__all__ = ["LoadQueue", "LoadEntry", "grants", "waits_for", "overlapping_loads"]

Status = Literal["arriving", "waiting", "loading", "idle"]


class LoadEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One model as the queue sees it: its GPUs, its place in declaration order, what it does now."""

    name: str
    gpus: tuple[int, ...]
    priority: int  # its index in declaration order (lower goes first)
    status: Status = "arriving"


def _ordered(entries: Sequence[LoadEntry]) -> list[LoadEntry]:
    return sorted(entries, key=lambda e: (e.priority, e.name))


def grants(entries: Sequence[LoadEntry]) -> list[str]:
    """The waiting entries that may start loading now (never two on one GPU). Pure."""
    claimed = {g for e in entries if e.status == "loading" for g in e.gpus}
    out: list[str] = []
    for e in _ordered(entries):
        if e.status not in ("waiting", "arriving"):
            continue
        if e.status == "waiting" and not claimed.intersection(e.gpus):
            out.append(e.name)
        claimed.update(e.gpus)  # whoever comes before holds its GPUs against those after it
    return out


def waits_for(entries: Sequence[LoadEntry], name: str) -> str:
    """What `name` waits for, in words (for its `loading` event): `GPU 0: m1 loading, m2 declared
    before it` ('' when it may go). Pure."""
    me = next((e for e in entries if e.name == name), None)
    if me is None or me.status not in ("waiting", "arriving") or name in grants(entries):
        return ""
    mine = set(me.gpus)
    loading = [e for e in _ordered(entries) if e.status == "loading" and e.name != name and mine.intersection(e.gpus)]
    ahead = [
        e
        for e in _ordered(entries)
        if e.status in ("waiting", "arriving")
        and e.name != name
        and (e.priority, e.name) < (me.priority, me.name)
        and mine.intersection(e.gpus)
    ]
    parts = [f"{e.name} loading" for e in loading] + [f"{e.name} declared before it" for e in ahead]
    gpus = ", ".join(str(g) for g in sorted(mine))
    return f"its turn on GPU {gpus} ({'; '.join(parts)}): one cold load at a time per GPU, in declaration order"


def overlapping_loads(windows: Sequence[tuple[str, tuple[int, ...], float, float]]) -> list[tuple[str, str]]:
    """Pairs of load windows (name, gpus, start, end) that overlap on a GPU: what the queue prevents.
    Pure; the tests and bench read recorded windows with it."""
    out = []
    for i, (a, ga, sa, ea) in enumerate(windows):
        for b, gb, sb, eb in windows[i + 1 :]:
            if set(ga) & set(gb) and sa < eb and sb < ea:
                out.append((a, b))
    return out


class LoadQueue:
    """The per-host load queue: the entries and one event per waiter. Single event loop, no threads."""

    def __init__(self, order: Callable[[], Sequence[str]] = lambda: ()) -> None:
        self._order = order
        self._gpus: dict[str, tuple[int, ...]] = {}
        self._status: dict[str, Status] = {}
        self._seq: dict[str, int] = {}  # enrolment order: the tie-break for names not (yet) declared
        self._wakeups: dict[str, asyncio.Event] = {}
        self._n = 0

    def entries(self) -> list[LoadEntry]:
        order = {name: i for i, name in enumerate(self._order())}
        base = len(order)
        return [
            LoadEntry(name=n, gpus=g, priority=order.get(n, base + self._seq[n]), status=self._status[n])
            for n, g in self._gpus.items()
        ]

    def status(self, name: str) -> str:
        return self._status.get(name, "")

    def enroll(self, name: str, gpus: Sequence[int]) -> None:
        """`name` will ask for a turn on `gpus` soon: those declared after it wait for it to ask."""
        self._n += 1
        self._gpus[name] = tuple(sorted(set(gpus)))
        self._status[name] = "arriving"
        self._seq[name] = self._n
        self._wakeups.setdefault(name, asyncio.Event())
        self._kick()

    def withdraw(self, name: str) -> None:
        for d in (self._gpus, self._status, self._seq):
            d.pop(name, None)
        ev = self._wakeups.pop(name, None)
        if ev is not None:
            ev.set()
        self._kick()

    def release(self, name: str) -> None:
        """The load is over (or `name` stands aside: adopting, waiting for its GPU, pulling)."""
        if name in self._status and self._status[name] != "idle":
            self._status[name] = "idle"
            self._kick()

    def waiting_text(self, name: str) -> str:
        return waits_for(self.entries(), name)

    async def acquire(self, name: str, on_wait: Callable[[str], Awaitable[object]] | None = None) -> None:
        """Wait for `name`'s turn; `on_wait(what it waits for)` is awaited once if it cannot go at once.
        An unenrolled name goes at once (nothing to order it against)."""
        if name not in self._gpus:
            return
        self._status[name] = "waiting"
        told = False
        try:
            while name in self._gpus:
                if name in grants(self.entries()):
                    self._status[name] = "loading"
                    self._kick()
                    return
                ev = self._wakeups.setdefault(name, asyncio.Event())
                ev.clear()
                if not told and on_wait is not None:
                    told = True
                    await on_wait(self.waiting_text(name))
                    continue  # the queue may have moved while it was recorded
                await ev.wait()
        except BaseException:
            self.release(name)  # cancelled or failed while waiting: it holds nothing, blocks nobody
            raise

    def _kick(self) -> None:
        for ev in self._wakeups.values():
            ev.set()
