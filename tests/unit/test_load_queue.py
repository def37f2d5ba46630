"""One cold load at a time per GPU, in declaration order (agents/load_queue.py): the rule, then the queue."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.agents.load_queue import LoadEntry, LoadQueue, grants, overlapping_loads, waits_for


def e(name: str, priority: int, status: str, *gpus: int) -> LoadEntry:
    return LoadEntry(name=name, gpus=tuple(gpus or (0,)), priority=priority, status=status)  # type: ignore[arg-type]


def test_the_first_declared_goes_first_and_alone_on_its_gpu():
    entries = [e("m1", 0, "waiting"), e("m2", 1, "waiting"), e("m3", 2, "waiting")]
    assert grants(entries) == ["m1"]
    assert grants([e("m1", 0, "loading"), e("m2", 1, "waiting")]) == []
    assert grants([e("m1", 0, "idle"), e("m2", 1, "waiting"), e("m3", 2, "waiting")]) == ["m2"]


def test_one_declared_before_that_has_not_asked_yet_is_waited_for():
    # at boot every supervisor starts at once: the third must not win the race against the first
    assert grants([e("m1", 0, "arriving"), e("m3", 2, "waiting")]) == []
    assert "m1 declared before it" in waits_for([e("m1", 0, "arriving"), e("m3", 2, "waiting")], "m3")


def test_gpus_are_independent_and_a_tensor_parallel_model_takes_all_of_its():
    assert grants([e("a", 0, "waiting", 0), e("b", 1, "waiting", 1)]) == ["a", "b"]
    entries = [e("tp", 0, "loading", 0, 1), e("a", 1, "waiting", 0), e("b", 2, "waiting", 1), e("c", 3, "waiting", 2)]
    assert grants(entries) == ["c"]
    assert grants([e("tp", 0, "waiting", 0, 1), e("b", 1, "waiting", 1)]) == ["tp"]


def test_what_it_waits_for_names_who_loads_and_who_is_ahead():
    entries = [e("m1", 0, "loading"), e("m2", 1, "waiting"), e("m3", 2, "waiting")]
    text = waits_for(entries, "m3")
    assert text.startswith("its turn on GPU 0 (m1 loading; m2 declared before it)")
    assert waits_for(entries, "m1") == ""


statuses = st.sampled_from(["arriving", "waiting", "loading", "idle"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(statuses, st.sets(st.integers(0, 2), min_size=1, max_size=2)), min_size=1, max_size=6))
def test_never_two_loads_on_one_gpu_and_never_ahead_of_one_declared_before(raw):
    entries = [LoadEntry(name=f"m{i}", gpus=tuple(sorted(g)), priority=i, status=s) for i, (s, g) in enumerate(raw)]  # type: ignore[arg-type]
    granted = grants(entries)
    held = [set(x.gpus) for x in entries if x.status == "loading"]
    after = held + [set(x.gpus) for x in entries if x.name in granted]
    # granting never puts a second load on a GPU that has one (loads already running are the input's)
    for x in entries:
        if x.name in granted:
            assert not any(set(x.gpus) & h for h in held)
            ahead = [y for y in entries if y.priority < x.priority and y.status in ("waiting", "arriving")]
            assert not any(set(x.gpus) & set(y.gpus) for y in ahead)
    granted_sets = [set(x.gpus) for x in entries if x.name in granted]
    for i, a in enumerate(granted_sets):
        for b in granted_sets[i + 1 :]:
            assert not a & b
    assert len(after) >= len(held)


def test_overlapping_windows_are_found_per_gpu():
    windows = [("a", (0,), 0.0, 1.0), ("b", (0,), 0.5, 2.0), ("c", (1,), 0.5, 2.0), ("d", (0,), 2.0, 3.0)]
    assert overlapping_loads(windows) == [("a", "b")]


async def test_the_queue_serves_in_declaration_order_whoever_asks_first():
    order = ["m1", "m2", "m3"]
    q = LoadQueue(order=lambda: order)
    for name in order:
        q.enroll(name, [0])
    done: list[str] = []
    told: dict[str, str] = {}

    async def load(name: str, delay: float) -> None:
        await asyncio.sleep(delay)

        async def on_wait(text: str) -> None:
            told[name] = text

        await q.acquire(name, on_wait)
        done.append(name)
        await asyncio.sleep(0.01)
        q.release(name)

    # m3 asks first, m1 last: they load m1, m2, m3 all the same, one at a time
    await asyncio.wait_for(asyncio.gather(load("m3", 0.0), load("m2", 0.005), load("m1", 0.01)), 5)
    assert done == ["m1", "m2", "m3"]
    assert "m1" not in told and "declared before it" in told["m3"]


async def test_one_that_stands_aside_or_is_withdrawn_holds_nobody_back():
    q = LoadQueue(order=lambda: ["m1", "m2", "m3"])
    for name in ("m1", "m2", "m3"):
        q.enroll(name, [0])
    q.release("m1")  # adopted: nothing to load
    q.withdraw("m2")  # retired
    await asyncio.wait_for(q.acquire("m3"), 1)
    assert q.status("m3") == "loading"


async def test_a_waiter_cancelled_holds_nothing():
    q = LoadQueue(order=lambda: ["m1", "m2", "m3"])
    for name in ("m1", "m2", "m3"):
        q.enroll(name, [0])
    await q.acquire("m1")
    waiter = asyncio.ensure_future(q.acquire("m2"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    q.release("m1")
    await asyncio.wait_for(q.acquire("m3"), 1)
