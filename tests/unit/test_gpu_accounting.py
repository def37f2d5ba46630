"""Per-process GPU accounting, pure: process trees, usage against the plan, foreign usage, and `haru status`."""

from __future__ import annotations

from datetime import timedelta

from haru.agents.gpu import Owner, account, process_tree
from haru.core import events as ev
from haru.core import subjects as sj
from haru.core.events import GpuProcess, GpuUsage
from haru.core.fold import fold
from haru.core.sizes import GiB, MiB
from haru.projections.status import render
from tests.support.status import NOW, F, hearth_fleet


def test_a_process_tree_is_the_roots_and_every_descendant():
    parents = {1: 0, 100: 1, 101: 100, 102: 100, 103: 102, 200: 1, 201: 200}
    assert process_tree({100}, parents) == {100, 101, 102, 103}
    assert process_tree({200, 999}, parents) == {200, 201, 999}  # a root /proc no longer lists is kept
    assert process_tree(set(), parents) == frozenset()


def test_usage_sums_each_tree_against_its_plan_and_the_rest_is_foreign():
    procs = [
        GpuProcess(pid=101, used_bytes=5 * GiB),
        GpuProcess(pid=103, used_bytes=2 * GiB),
        GpuProcess(pid=300, used_bytes=3 * GiB),
        GpuProcess(pid=201, used_bytes=GiB),
        GpuProcess(pid=7, used_bytes=MiB),
    ]
    owners = [
        Owner(name="m1", pids=frozenset({100, 101, 102, 103}), planned_bytes=6 * GiB),
        Owner(name="m2", pids=frozenset({400}), planned_bytes=GiB),
        Owner(name="lora", kind="training", pids=frozenset({200, 201}), planned_bytes=8 * GiB),
    ]
    usage, foreign = account(procs, owners, exclude=frozenset({7}))
    assert usage == [
        GpuUsage(name="m1", kind="model", pids=[101, 103], used_bytes=7 * GiB, planned_bytes=6 * GiB, over_plan=True),
        GpuUsage(name="m2", kind="model", pids=[], used_bytes=0, planned_bytes=GiB, over_plan=False),
        GpuUsage(name="lora", kind="training", pids=[201], used_bytes=GiB, planned_bytes=8 * GiB, over_plan=False),
    ]
    assert foreign == [GpuProcess(pid=300, used_bytes=3 * GiB)]  # the agent's own pid (7) is excluded


def test_exactly_the_plan_is_not_an_anomaly():
    usage, foreign = account(
        [GpuProcess(pid=1, used_bytes=GiB)], [Owner(name="m", pids=frozenset({1}), planned_bytes=GiB)]
    )
    assert not usage[0].over_plan and foreign == []


def test_status_shows_over_plan_and_foreign_usage_with_figures_and_pids():
    items = hearth_fleet() + [
        (
            sj.gpu(F, "a", 0),
            ev.GpuObserved(
                at=NOW - timedelta(seconds=1),
                domain="a",
                index=0,
                present=True,
                memory_total_bytes=48 * GiB,
                memory_used_bytes=40 * GiB,
                accounted=True,
                processes=[GpuProcess(pid=4242, used_bytes=int(21.5 * GiB)), GpuProcess(pid=9001, used_bytes=2 * GiB)],
                usage=[
                    GpuUsage(
                        name="muse-local:latest",
                        pids=[4242],
                        used_bytes=int(21.5 * GiB),
                        planned_bytes=20 * GiB,
                        over_plan=True,
                    ),
                    GpuUsage(name="deepseek-r1:32b", pids=[4300], used_bytes=10 * GiB, planned_bytes=22 * GiB),
                ],
                foreign=[GpuProcess(pid=9001, used_bytes=2 * GiB)],
            ),
        )
    ]
    view = fold((i + 1, s, e) for i, (s, e) in enumerate(items))[F]
    lines = render(view, NOW).splitlines()
    assert "    OVER PLAN  muse-local:latest holds 21.5 GiB, planned 20.0 GiB (pid 4242)" in lines
    assert "    FOREIGN    pid 9001 holds 2.0 GiB (a process Haru did not start)" in lines
    assert not any("deepseek" in line and "OVER PLAN" in line for line in lines)
    gpu = view.domains["a"].gpus[0]
    assert gpu.accounted and gpu.foreign == [GpuProcess(pid=9001, used_bytes=2 * GiB)]
