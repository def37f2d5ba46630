"""The host as it really is, in the plan: host RAM (sleeping weights, trainers) and models across GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core.errors import LayoutError
from haru.core.launch import launch
from haru.core.layout import load_layout, parse_layout
from haru.core.planner import plan, sleeping_host_ram, verdict_line
from haru.core.specs import Domain, DomainSpec, GiB, GpuSpec, ModelSpec, Policy, TrainingSpec

ROOT = Path(__file__).resolve().parents[2]


def host(ram: int, reserve: int, models: list[ModelSpec], training: list[TrainingSpec] = (), gpus: int = 1) -> Domain:
    return Domain(
        spec=DomainSpec(
            name="a",
            gpus=[GpuSpec(index=i, memory_bytes=48 * GiB, reserve_bytes=2 * GiB) for i in range(gpus)],
            host_ram_bytes=ram,
            host_ram_reserve_bytes=reserve,
        ),
        models=models,
        training=list(training),
    )


def model(name: str, vram: int, *, ram: int = 0, runtime: str = "vllm", gpus: list[int] = ()) -> ModelSpec:
    return ModelSpec(
        name=name,
        slot="s",
        gpu_index=(list(gpus) or [0])[0],
        vram_bytes=vram,
        runtime=runtime,  # type: ignore[arg-type]
        host_ram_bytes=ram,
        gpu_indexes=list(gpus),
    )


def trainer(slot: str, vram: int, ram: int) -> TrainingSpec:
    return TrainingSpec(slot=slot, gpu_index=0, command=["x"], checkpoint_dir="/c", vram_bytes=vram, host_ram_bytes=ram)


# ------------------------------------------------------------------------------------- host RAM


def test_sleeping_weights_are_declared_or_bounded_by_the_vram():
    assert sleeping_host_ram(model("m", 10 * GiB, ram=6 * GiB)) == 6 * GiB  # declared: its weights
    assert sleeping_host_ram(model("m", 10 * GiB)) == 10 * GiB  # not declared: its VRAM, an upper bound
    assert sleeping_host_ram(model("m", 10 * GiB, gpus=[0, 1])) == 20 * GiB  # on each GPU it spans
    assert sleeping_host_ram(model("m", 10 * GiB, runtime="llama_server")) == 0  # no sleep: stays in VRAM


def test_host_ram_refuses_what_cannot_fit_with_the_exact_shortfall_in_the_same_words():
    # 64 GiB of host RAM, 8 reserved: 56 to plan. 20 + 20 fit; the third model's 20 is 4 short.
    d = host(
        64 * GiB,
        8 * GiB,
        [
            model("m1", 10 * GiB, ram=20 * GiB),
            model("m2", 10 * GiB, ram=20 * GiB),
            model("m3", 10 * GiB, ram=20 * GiB),
            model("m4", 10 * GiB, ram=10 * GiB),
        ],
        [trainer("lora", 4 * GiB, 8 * GiB)],
    )
    (dp,) = plan(d, Policy()).domains
    v = {x.name: x for x in dp.verdicts()}
    assert [v[n].admitted for n in ("m1", "m2", "m3", "m4")] == [True, True, False, True]  # first fit, in order
    assert v["m3"].resource == "host_ram" and v["m3"].short_by_bytes == 4 * GiB and v["m3"].left_bytes == 16 * GiB
    assert v["m3"].capacity_bytes == 56 * GiB
    assert verdict_line(v["m3"]) == "m3                           not admitted — short by 4.0 GiB of host RAM"
    # the training slot's host RAM comes after every model: 6 GiB left, it needs 8
    assert not v["lora"].admitted and v["lora"].resource == "host_ram" and v["lora"].short_by_bytes == 2 * GiB
    assert dp.host_ram_held_bytes == 50 * GiB and dp.host_ram_capacity_bytes == 56 * GiB
    assert dp.host_ram_summary() == "host RAM 50.0 / 56.0 GiB held  (3 sleeping models, 0 training slots)"
    # m3 refused on host RAM leaves its VRAM to those after it
    (g,) = dp.gpus
    assert g.held_bytes == 30 * GiB


def test_a_vram_shortfall_is_said_before_a_host_ram_one():
    d = host(8 * GiB, 0, [model("big", 47 * GiB, ram=16 * GiB)])
    (v,) = plan(d, Policy()).verdicts()
    assert v.resource == "vram" and v.short_by_bytes == 1 * GiB
    assert verdict_line(v).endswith("not admitted — short by 1.0 GiB")


def test_a_domain_without_host_ram_declared_is_not_planned_on_it():
    (dp,) = plan(host(0, 0, [model("m", 40 * GiB, ram=900 * GiB)]), Policy()).domains
    assert dp.verdicts()[0].admitted and dp.host_ram_summary() == "" and dp.host_ram_held_bytes == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 128), st.integers(0, 16), st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), max_size=6))
def test_host_ram_is_never_planned_into_the_reserve(ram_gib, reserve_gib, items):
    reserve = min(reserve_gib, ram_gib)
    models = [model(f"m{i}", v * GiB, ram=r * GiB) for i, (v, r) in enumerate(items)]
    (dp,) = plan(host(ram_gib * GiB, reserve * GiB, models), Policy()).domains
    if ram_gib:
        assert dp.host_ram_held_bytes <= (ram_gib - reserve) * GiB
        for v in dp.verdicts():
            if not v.admitted and v.resource == "host_ram":
                assert v.short_by_bytes == v.host_ram_bytes - v.left_bytes > 0


# ------------------------------------------------------------------------------ across GPUs


def test_a_model_across_gpus_is_booked_on_each_and_they_are_taken_for_the_rest():
    tp = model("llama-70b", 40 * GiB, gpus=[0, 1])  # then "small" on GPU 1 alone: 46 - 40 = 6 left there
    d = Domain(
        spec=DomainSpec(
            name="a", gpus=[GpuSpec(index=i, memory_bytes=48 * GiB, reserve_bytes=2 * GiB) for i in (0, 1)]
        ),
        models=[tp, ModelSpec(name="small", slot="s1", gpu_index=1, vram_bytes=8 * GiB)],
        training=[TrainingSpec(slot="t", gpu_index=1, command=["x"], checkpoint_dir="/c", vram_bytes=46 * GiB)],
    )
    (dp,) = plan(d, Policy()).domains
    g0, g1 = dp.gpus
    assert g0.held_bytes == 40 * GiB and g1.held_bytes == 40 * GiB and g1.spanned == ["llama-70b"]
    assert [v.name for v in g0.models] == ["llama-70b"]  # its verdict is listed once, under its first GPU
    small = dp.verdicts()[1]
    assert small.name == "small" and not small.admitted and small.short_by_bytes == 2 * GiB
    # training on GPU 1 sees the sleeping model's residual there too
    assert g1.residual_bytes == Policy().sleep_residual_bytes
    t = next(v for v in dp.verdicts() if v.kind == "training")
    assert not t.admitted and t.short_by_bytes == Policy().sleep_residual_bytes
    assert "on each of GPUs 0, 1" in verdict_line(dp.verdicts()[0])


def test_a_model_across_gpus_is_refused_when_any_of_them_is_short():
    d = Domain(
        spec=DomainSpec(
            name="a", gpus=[GpuSpec(index=0, memory_bytes=48 * GiB), GpuSpec(index=1, memory_bytes=24 * GiB)]
        ),
        models=[model("tp", 30 * GiB, gpus=[0, 1])],
    )
    (v,) = plan(d, Policy()).verdicts()
    assert not v.admitted and v.short_by_bytes == 6 * GiB and v.capacity_bytes == 24 * GiB


def test_vllm_and_llama_server_are_launched_across_the_gpus():
    vllm = launch(
        ModelSpec(name="tp", slot="s", gpu_index=2, vram_bytes=40 * GiB, source="meta/llama", gpu_indexes=[2, 3]),
        gpu_memory_bytes=48 * GiB,
        port=8000,
    )
    assert vllm.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    argv = vllm.argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.833"  # 40 of 48 GiB, on each GPU
    llama = launch(
        ModelSpec(
            name="tp",
            slot="s",
            gpu_index=0,
            runtime="llama_server",
            vram_bytes=20 * GiB,
            source="/m.gguf",
            gpu_indexes=[0, 1],
        ),
        gpu_memory_bytes=24 * GiB,
        port=8000,
    )
    assert llama.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert llama.argv[llama.argv.index("--split-mode") + 1] == "layer"
    assert llama.argv[llama.argv.index("--tensor-split") + 1] == "1,1"
    one = launch(
        ModelSpec(name="m", slot="s", gpu_index=1, vram_bytes=4 * GiB, source="org/m"),
        gpu_memory_bytes=48 * GiB,
        port=1,
    )
    assert "--tensor-parallel-size" not in one.argv and one.env["CUDA_VISIBLE_DEVICES"] == "1"


LAYOUT = {
    "fleet": "f",
    "domains": [
        {
            "name": "a",
            "host_ram": "64GiB",
            "host_ram_reserve": "8GiB",
            "gpus": [{"index": 0, "memory": "48GiB"}, {"index": 1, "memory": "48GiB"}],
            "slots": [
                {
                    "name": "big",
                    "gpu": 0,
                    "models": [
                        {"name": "llama", "source": "meta/llama", "vram": "40GiB", "gpus": [0, 1], "host_ram": "35GiB"}
                    ],
                },
                {
                    "name": "lora",
                    "kind": "training",
                    "gpu": 1,
                    "command": ["t"],
                    "checkpoint_dir": "/c",
                    "vram": "4GiB",
                    "host_ram": "24GiB",
                },
            ],
        }
    ],
}


def test_the_layout_declares_host_ram_and_gpus():
    layout = parse_layout(LAYOUT)
    (d,) = layout.domains
    assert d.spec.host_ram_bytes == 64 * GiB and d.spec.host_ram_reserve_bytes == 8 * GiB
    assert d.models[0].gpu_indexes == [0, 1] and d.models[0].host_ram_bytes == 35 * GiB
    assert d.training[0].host_ram_bytes == 24 * GiB
    (dp,) = plan(layout).domains
    assert [v.admitted for v in dp.verdicts()] == [True, False]  # 35 + 24 > 64 - 8
    lora = dp.verdicts()[1]
    assert lora.resource == "host_ram" and lora.short_by_bytes == 3 * GiB


@pytest.mark.parametrize(
    "change, path",
    [
        (lambda d: d["slots"][0]["models"][0].update(gpus=[0, 5]), "$.domains[0].slots[0].models[0].gpus[1]"),
        (lambda d: d["slots"][0]["models"][0].update(gpus=[1, 1]), "$.domains[0].slots[0].models[0].gpus[1]"),
        (lambda d: d["slots"][0]["models"][0].update(gpus=[1]), "$.domains[0].slots[0].models[0].gpus"),
        (lambda d: d.update(host_ram_reserve="128GiB"), "$.domains[0].host_ram_reserve"),
        (lambda d: d.update(host_ram="lots"), "$.domains[0].host_ram"),
        (lambda d: d["slots"][0]["models"][0].update(args=["-tp", "4"]), "$.domains[0].slots[0].models[0].args[0]"),
    ],
)
def test_the_layout_refuses_a_bad_declaration_where_it_is(change, path):
    import copy

    doc = copy.deepcopy(LAYOUT)
    change(doc["domains"][0])
    with pytest.raises(LayoutError) as err:
        parse_layout(doc)
    assert err.value.path == path


def test_the_two_gpu_example_plans():
    layout = load_layout(ROOT / "deploy/examples/two-gpu-fleet.json")
    p = plan(layout)
    assert len(p.domains) == 2
    for dp in p.domains:
        assert len(dp.gpus) == 2 and not dp.verdicts() == []
        assert all(v.admitted for v in dp.verdicts()), [verdict_line(v) for v in dp.not_admitted()]
        assert any(len(v.gpu_indexes) == 2 for v in dp.verdicts())  # a model across both GPUs
        assert dp.host_ram_capacity_bytes and dp.host_ram_held_bytes <= dp.host_ram_capacity_bytes


# ------------------------------------------------------------------- apply, the view, haru status


def test_apply_records_the_host_ram_verdict_and_haru_status_shows_host_ram_held_and_used():
    from datetime import UTC, datetime

    from haru.agents.host_ram import parse_meminfo
    from haru.core import events as ev
    from haru.core import subjects as sj
    from haru.core.apply import Declarations, describe, diff
    from haru.core.fold import fold
    from haru.projections.status import render

    layout = parse_layout(LAYOUT)
    now = datetime(2026, 12, 1, tzinfo=UTC)
    events = diff(Declarations(), layout, plan(layout), now)
    refused = [e for e in events if isinstance(e, ev.AdmissionDecided) and not e.admitted]
    assert [(e.name, e.resource, e.short_by_bytes) for e in refused] == [("lora", "host_ram", 3 * GiB)]
    assert describe(refused[0]) == "= admission_decided a/lora (training): not admitted, short by 3.0 GiB of host RAM"
    info = parse_meminfo(
        "MemTotal:       67108864 kB\nMemFree:  1 kB\nMemAvailable:   50331648 kB\nHugePages_Total: 0\n"
    )
    assert info["MemTotal"] == 64 * GiB and info["MemAvailable"] == 48 * GiB and info["HugePages_Total"] == 0
    entries = [(i + 1, sj.decl("f"), e) for i, e in enumerate(events)]
    entries.append(
        (
            len(entries) + 1,
            sj.agent("f", "a"),
            ev.AgentStarted(
                at=now,
                domain="a",
                host="h",
                host_ram_total_bytes=info["MemTotal"],
                host_ram_available_bytes=info["MemAvailable"],
            ),
        )
    )
    text = render(fold(entries)["f"], now)
    lines = text.splitlines()
    assert (
        "  host RAM 35.0 / 56.0 GiB held  (1 sleeping model, 0 training slots)  · 16.0 of 64.0 GiB used at agent start"
    ) in lines, text
    assert "  training lora (GPU 1)          not admitted — short by 3.0 GiB of host RAM" in lines, text
    # GPU 1 holds the model across GPUs too
    assert any(line.startswith("  GPU 1: 40.0 / 48.0 GiB held") and "llama across GPUs" in line for line in lines), text
    # re-applying the same layout changes nothing
    from haru.core.apply import fold_declarations

    assert diff(fold_declarations(events), layout, plan(layout), now) == []


# ------------------------------------------------------------------- host RAM as the agent measured it


def test_a_domain_without_declared_host_ram_is_planned_on_what_its_agent_measured():
    from haru.core.planner import MEASURED_RESERVE_MIN, with_measured_host_ram
    from haru.core.specs import Layout

    layout = Layout(fleet="f", domains=[host(0, 0, [model("a", 20 * GiB), model("b", 20 * GiB)])])
    assert plan(layout).domains[0].host_ram_bytes == 0  # nothing measured yet: host RAM not planned
    measured = with_measured_host_ram(layout, {"a": 32 * GiB})
    p = plan(measured).domains[0]
    # 32 GiB measured, 10% of it reserved: 28.8 GiB to plan; 20 fits, the second 20 is short
    assert (p.host_ram_bytes, p.host_ram_reserve_bytes) == (32 * GiB, 32 * GiB // 10)
    refused = [v for v in p.verdicts() if not v.admitted]
    assert [v.resource for v in refused] == ["host_ram"] and "host RAM" in verdict_line(refused[0])
    small = plan(with_measured_host_ram(layout, {"a": 8 * GiB})).domains[0]
    assert small.host_ram_reserve_bytes == MEASURED_RESERVE_MIN  # 10% of 8 GiB is under the floor
    declared = Layout(fleet="f", domains=[host(64 * GiB, 4 * GiB, [model("a", 20 * GiB)])])
    assert with_measured_host_ram(declared, {"a": 8 * GiB}) == declared  # what the layout declares wins
    assert layout.domains[0].spec.host_ram_bytes == 0  # the declaration itself is left as written


async def test_apply_plans_host_ram_from_the_agents_last_start():
    from datetime import UTC, datetime

    from haru.core import subjects
    from haru.core.events import AgentStarted
    from haru.core.specs import Layout
    from haru.log.apply import apply
    from haru.log.memory import MemoryLog

    now = datetime(2026, 12, 6, tzinfo=UTC)
    layout = Layout(fleet="f", domains=[host(0, 0, [model("a", 20 * GiB), model("b", 20 * GiB)])])
    log = MemoryLog()
    first = await apply(log, layout, now, dry_run=True)
    assert all(v.admitted for v in first.plan.verdicts())  # no agent has started: not planned
    await log.append(
        subjects.agent("f", "a"), AgentStarted(at=now, domain="a", host_ram_total_bytes=32 * GiB), expect=0
    )
    second = await apply(log, layout, now, dry_run=True)
    assert [v.admitted for v in second.plan.verdicts()] == [True, False]
