"""The agent package's shape: its modules import each other without a cycle (module level and inside
functions alike), the command service and the serving port import nothing from agents/agent.py,
docs/agent.md carries the decision table as the code has it, and verify_gpu judges the readings it is given."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace as NS

from haru.agents.gpu import GpuReading
from haru.agents.observe import decision_table_markdown
from haru.core.sizes import GiB

ROOT = Path(__file__).resolve().parents[2]


def _imports() -> dict[str, set[str]]:
    """haru.agents.* module -> the haru.agents.* modules it imports (anywhere but under `if TYPE_CHECKING:`)."""
    mods = {}
    for path in (ROOT / "agents").rglob("*.py"):
        name = "haru." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found: set[str] = set()

        def visit(node: ast.AST, found: set[str] = found) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text()))
        graph[name] = {d for d in found if d in mods and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def dfs(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := dfs(dep)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return []


def test_the_agent_package_imports_without_a_cycle():
    graph = _imports()
    assert "haru.agents.agent" in graph and "haru.agents.supervisor" in graph
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_outer_units_do_not_import_the_agent():
    graph = _imports()
    for unit in (
        "haru.agents.commands",
        "haru.agents.serving",
        "haru.agents.supervisor",
        "haru.agents.recorder",
        "haru.agents.training_slots",
        "haru.agents.gpu_watch",
        "haru.agents.heartbeat",
        "haru.agents.observe",
        "haru.agents.pulling",
    ):
        assert "haru.agents.agent" not in graph[unit], unit
    assert graph["haru.agents.observe"] <= {"haru.agents.errors"}  # the pure table: nothing of the shell


def test_docs_carry_the_decision_table_as_the_code_has_it():
    assert decision_table_markdown() in (ROOT / "docs" / "agent.md").read_text(), (
        "docs/agent.md must carry agents.observe.decision_table_markdown() as it prints"
    )


def test_the_gpu_verdict_from_readings_passed_in():
    from haru.agents.gpu_verdict import gpus_of, judge_gpus
    from haru.core.residency import Resident

    def model(name, gpu, state, kind="vllm"):
        return NS(
            name=name,
            state_tag=state,
            spec=NS(gpu_index=gpu, gpu_indexes=[], vram_bytes=10 * GiB),
            runtime=NS(kind=kind, can_sleep=kind == "vllm"),
            state=Resident(),
        )

    idle = NS(group_pids=lambda: set(), ended=None, running=lambda: False)
    models = [model("a", 0, "sleeping"), model("b", 1, "sleeping"), model("x", 2, "resident", kind="external")]
    assert gpus_of(models) == [0, 1]
    readings = {
        0: GpuReading(index=0, present=True, memory_free_bytes=4 * GiB, memory_total_bytes=24 * GiB),
        1: GpuReading(index=1, present=None),
    }
    verdict = judge_gpus(models, {"lora": idle}, readings, residual_bytes=GiB, pid_alive=lambda pid: False)
    assert not verdict.ok and verdict.error.code == "gpu_busy"
    assert "GPU 0 has 4294967296 bytes free; its sleeping models need 9663676416 to wake" in verdict.error.message
    assert verdict.data["gpus"]["1"]["nvml"] is False and verdict.data["unverified"][0].startswith("GPU 1: NVML absent")
    readings[0] = GpuReading(index=0, present=True, memory_free_bytes=20 * GiB, memory_total_bytes=24 * GiB)
    assert judge_gpus(models, {"lora": idle}, readings, residual_bytes=GiB, pid_alive=lambda pid: False).ok
    running = NS(group_pids=lambda: {4242}, ended=None, running=lambda: True)
    verdict = judge_gpus(models, {"lora": running}, readings, residual_bytes=GiB, pid_alive=lambda pid: pid == 4242)
    assert verdict.error.code == "training_running" and "trainer processes [4242] still run" in verdict.error.message
