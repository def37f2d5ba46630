"""The VRAM planner: hearth's numbers, first fit in declaration order, exact shortfalls, training."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core.layout import load_layout
from haru.core.planner import first_fit, gpu_summary_line, plan, verdict_line
from haru.core.sizes import GiB, MiB, format_gib
from haru.core.specs import Domain, DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec

ROOT = Path(__file__).resolve().parents[2]


def domain(memory: int, reserve: int, sizes: list[int], training: list[int] = (), runtime: str = "vllm") -> Domain:
    return Domain(
        spec=DomainSpec(name="a", gpus=[GpuSpec(index=0, memory_bytes=memory, reserve_bytes=reserve)]),
        models=[
            ModelSpec(name=f"m{i}", slot="s", gpu_index=0, vram_bytes=s, runtime=runtime) for i, s in enumerate(sizes)
        ],
        training=[
            TrainingSpec(slot=f"t{i}", gpu_index=0, command=["x"], checkpoint_dir="/c", vram_bytes=v)
            for i, v in enumerate(training)
        ],
    )


def test_hearth_comes_out_exactly():
    layout = load_layout(ROOT / "deploy/examples/hearth.json")
    p = plan(layout)
    for d in p.domains:
        (g,) = d.gpus
        assert g.summary() == "42.0 / 44.2 GiB held  (5 declared, 2 admitted)"
        refused = [v for v in g.models if not v.admitted]
        assert [v.name for v in refused] == ["gemma4:26b", "qwen3.6:27b", "gemma4-extract:31b"]
        assert [format_gib(v.short_by_bytes) for v in refused] == ["14.8 GiB", "15.8 GiB", "17.8 GiB"]
        assert verdict_line(refused[0]) == "gemma4:26b                   not admitted — short by 14.8 GiB"
        assert [v.name for v in g.models if v.admitted] == ["muse-local:latest", "deepseek-r1:32b"]


def test_formatting_helpers():
    assert format_gib(int(14.8 * GiB)) == "14.8 GiB"
    assert format_gib(0) == "0.0 GiB"
    assert gpu_summary_line(42 * GiB, round(44.2 * GiB), 5, 2) == "42.0 / 44.2 GiB held  (5 declared, 2 admitted)"


def test_first_fit_not_best_fit():
    # 10 GiB left after the first; the 12 GiB does not fit, the 9 GiB after it does: order is priority.
    d = domain(24 * GiB, 2 * GiB, [12 * GiB, 12 * GiB, 9 * GiB])
    (g,) = plan(d, Policy()).domains[0].gpus
    assert [v.admitted for v in g.models] == [True, False, True]
    assert g.models[1].short_by_bytes == 2 * GiB
    # Best fit would have admitted 12 + 9 = 21 and refused nothing smaller; reordering changes who is refused.
    (g2,) = plan(domain(24 * GiB, 2 * GiB, [9 * GiB, 12 * GiB, 12 * GiB]), Policy()).domains[0].gpus
    assert [v.admitted for v in g2.models] == [True, True, False]


def test_reserve_is_never_planned_into():
    (g,) = plan(domain(24 * GiB, 2 * GiB, [22 * GiB + 1]), Policy()).domains[0].gpus
    assert not g.models[0].admitted and g.models[0].short_by_bytes == 1
    (g,) = plan(domain(24 * GiB, 2 * GiB, [22 * GiB]), Policy()).domains[0].gpus
    assert g.models[0].admitted and g.held_bytes == 22 * GiB


def test_training_fits_beside_sleeping_residuals():
    pol = Policy(sleep_residual_bytes=512 * MiB)
    # capacity 22 GiB, two vLLM runtimes admitted -> 1 GiB residual -> 21 GiB of room for training.
    (g,) = plan(domain(24 * GiB, 2 * GiB, [10 * GiB, 10 * GiB], [21 * GiB]), pol).domains[0].gpus
    assert g.training[0].admitted and g.residual_bytes == GiB and g.training_bytes == 21 * GiB
    (g,) = plan(domain(24 * GiB, 2 * GiB, [10 * GiB, 10 * GiB], [21 * GiB + 5]), pol).domains[0].gpus
    assert not g.training[0].admitted and g.training[0].short_by_bytes == 5
    # A runtime that was not admitted never runs, so it leaves no residual.
    (g,) = plan(domain(24 * GiB, 2 * GiB, [10 * GiB, 30 * GiB], [21 * GiB]), pol).domains[0].gpus
    assert g.residual_bytes == 512 * MiB and g.training[0].admitted


def test_llama_server_cannot_sleep_so_keeps_its_vram():
    (g,) = plan(domain(24 * GiB, 2 * GiB, [10 * GiB], [12 * GiB + 1], runtime="llama_server"), Policy()).domains[0].gpus
    assert g.residual_bytes == 10 * GiB
    assert not g.training[0].admitted and g.training[0].short_by_bytes == 1


def test_training_slots_first_fit_among_themselves():
    pol = Policy(sleep_residual_bytes=0)
    (g,) = plan(domain(24 * GiB, 4 * GiB, [], [15 * GiB, 6 * GiB, 5 * GiB]), pol).domains[0].gpus
    assert [v.admitted for v in g.training] == [True, False, True]
    assert g.training[1].short_by_bytes == GiB


def test_model_on_an_undeclared_gpu_is_never_admitted():
    d = Domain(
        spec=DomainSpec(name="a", gpus=[GpuSpec(index=0, memory_bytes=8 * GiB)]),
        models=[ModelSpec(name="m", slot="s", gpu_index=2, vram_bytes=GiB)],
    )
    v = plan(d).verdict("a", "m")
    assert v is not None and not v.admitted and v.short_by_bytes == GiB and v.capacity_bytes == 0


def test_plan_of_a_layout_uses_its_policy_and_verdict_lookup():
    layout = load_layout(ROOT / "deploy/examples/demo-fleet.json")
    p = plan(layout)
    assert [d.domain for d in p.domains] == ["a", "b"]
    v = p.verdict("b", "Qwen/Qwen3-4B-Instruct")
    assert v is not None and v.admitted and v.capacity_bytes == 22 * GiB
    assert p.verdict("b", "lora", kind="training").admitted
    assert p.not_admitted() == []


sizes = st.lists(st.integers(min_value=0, max_value=64 * GiB), max_size=12)


@settings(max_examples=300, deadline=None)
@given(memory=st.integers(min_value=1, max_value=96 * GiB), reserve_frac=st.floats(0, 1), sizes=sizes)
def test_properties(memory, reserve_frac, sizes):
    reserve = int(memory * reserve_frac)
    capacity = memory - reserve
    (g,) = plan(domain(memory, reserve, sizes), Policy()).domains[0].gpus
    assert g.capacity_bytes == capacity
    # admitted VRAM never exceeds memory - reserve
    assert g.held_bytes == sum(v.vram_bytes for v in g.models if v.admitted) <= capacity
    left = capacity
    for size, v in zip(sizes, g.models, strict=True):
        # the order of the input is the order of the verdicts (priority)
        assert v.vram_bytes == size
        # admitted iff it fits in what its predecessors left; short_by exact
        assert v.admitted == (size <= left)
        assert v.short_by_bytes == (0 if v.admitted else size - left)
        assert v.left_bytes == left
        if v.admitted:
            left -= size
        else:
            assert v.short_by_bytes > 0


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, capacity=st.integers(min_value=0, max_value=96 * GiB))
def test_priority_prefix_is_stable(sizes, capacity):
    """Appending models never changes the verdicts of those declared before them."""
    full = first_fit(sizes, capacity)
    for n in range(len(sizes)):
        assert first_fit(sizes[:n], capacity) == full[:n]


@settings(max_examples=200, deadline=None)
@given(
    sizes=sizes,
    train=st.lists(st.integers(0, 64 * GiB), max_size=4),
    residual=st.integers(0, 2 * GiB),
    memory=st.integers(1, 96 * GiB),
)
def test_training_never_exceeds_room_beside_residuals(sizes, train, residual, memory):
    reserve = memory // 10
    (g,) = plan(domain(memory, reserve, sizes, train), Policy(sleep_residual_bytes=residual)).domains[0].gpus
    admitted = sum(1 for v in g.models if v.admitted)
    assert g.residual_bytes == admitted * residual
    assert g.training_bytes + g.residual_bytes <= g.capacity_bytes or g.training_bytes == 0
    room = max(0, g.capacity_bytes - g.residual_bytes)
    for v in g.training:
        assert v.admitted == (v.vram_bytes <= room)
        assert v.short_by_bytes == (0 if v.admitted else v.vram_bytes - room)
        if v.admitted:
            room -= v.vram_bytes
