"""The agent's pure parts: its config, the declarations fold, GPU change detection, the trainer env."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from haru.agents.config import fold_declarations, load_config, parse_config, slots_from_host_entry, slots_from_layout
from haru.agents.gpu import GpuReading
from haru.agents.gpu_watch import GPU_USED_THRESHOLD
from haru.agents.gpu_watch import gpu_changed as _gpu_changed
from haru.agents.training import training_env
from haru.core.errors import ConfigError
from haru.core.events import (
    AdmissionDecided,
    DomainDeclared,
    FleetDeclared,
    GpuObserved,
    GpuProcess,
    ModelDeclared,
    ModelRetired,
    TrainingDeclared,
)
from haru.core.layout import parse_layout
from haru.core.sizes import GiB
from haru.core.specs import DomainSpec, GpuSpec, ModelSpec, Policy, TrainingSpec

T = datetime(2026, 1, 1, tzinfo=UTC)


def test_config_defaults_and_servers():
    c = parse_config(json.dumps({"fleet": "f", "domain": "a", "nats_url": "nats://x:1, nats://y:2"}))
    assert c.servers() == ["nats://x:1", "nats://y:2"]
    assert c.gpus == "nvml" and c.role == "auto" and c.heartbeat_ms == 1000 and c.serving.host == "127.0.0.1"
    assert str(c.state_path()).endswith("haru/agent-f-a")


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"fleet": "f"}, "domain"),
        ({"fleet": "f", "domain": "a", "gpus": "sim"}, "sim_dir"),
        ({"fleet": "f", "domain": "a", "color": "red"}, "color"),
        ({"fleet": "F", "domain": "a"}, "fleet name 'F'"),
        ({"fleet": "f", "domain": "a", "role": "leader"}, "role"),
    ],
)
def test_config_errors_name_what_is_wrong(doc, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(json.dumps(doc))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the agent config"):
        load_config(tmp_path / "nope.json")


def test_relative_layout_path_is_resolved_next_to_the_config(tmp_path):
    (tmp_path / "host.json").write_text(json.dumps({"fleet": "f", "domain": "a", "layout": "fleet.json"}))
    assert load_config(tmp_path / "host.json").layout == str(tmp_path / "fleet.json")


def _layout(models_a):
    def dom(name):
        return {
            "name": name,
            "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}],
            "slots": [
                {"name": "chat", "gpu": 0, "models": models_a},
                {
                    "name": "lora",
                    "kind": "training",
                    "gpu": 0,
                    "command": ["t"],
                    "checkpoint_dir": "/c",
                    "vram": "8GiB",
                },
            ],
        }

    return parse_layout({"fleet": "f", "domains": [dom("a"), dom("b")]})


def test_layout_slots_run_only_what_the_planner_admits():
    layout = _layout([{"name": "m1", "vram": "12GiB"}, {"name": "m2", "vram": "12GiB"}, {"name": "m3", "vram": "8GiB"}])
    slots = slots_from_layout(layout, "b")
    assert [m.name for m in slots.admitted_models] == ["m1", "m3"]  # first fit, in declaration order
    assert slots.not_admitted == {"m2": 2 * GiB}
    assert [t.slot for t in slots.admitted_training] == ["lora"]
    assert slots.first_domain == "a"
    with pytest.raises(ConfigError, match="no domain 'c'"):
        slots_from_layout(layout, "c")


def test_host_entry_is_validated_like_a_layout_domain():
    host = {
        "gpus": [{"index": 0, "memory": "24GiB"}],
        "slots": [{"name": "chat", "gpu": 0, "models": [{"name": "m", "vram": "4GiB"}]}],
    }
    slots = slots_from_host_entry("f", "a", host, {"probe_interval_ms": 200})
    assert [m.name for m in slots.admitted_models] == ["m"] and slots.policy.probe_interval_ms == 200
    assert slots.source == "config"
    bad = {
        "gpus": [{"index": 0, "memory": "24GiB"}],
        "slots": [{"name": "chat", "gpu": 3, "models": [{"name": "m", "vram": "4GiB"}]}],
    }
    with pytest.raises(ConfigError, match=r"\$\.host"):
        slots_from_host_entry("f", "a", bad, None)


def test_fold_declarations_keeps_admitted_models_of_this_domain():
    spec = lambda n: ModelSpec(name=n, slot="chat", gpu_index=0, vram_bytes=GiB)  # noqa: E731
    events = [
        FleetDeclared(at=T, fleet="f", policy=Policy(probe_interval_ms=123)),
        DomainDeclared(at=T, spec=DomainSpec(name="a", gpus=[GpuSpec(index=0, memory_bytes=24 * GiB)])),
        DomainDeclared(at=T, spec=DomainSpec(name="b", gpus=[GpuSpec(index=0, memory_bytes=24 * GiB)])),
        ModelDeclared(at=T, domain="a", spec=spec("x")),
        ModelDeclared(at=T, domain="a", spec=spec("y")),
        ModelDeclared(at=T, domain="a", spec=spec("gone")),
        ModelDeclared(at=T, domain="b", spec=spec("x")),
        TrainingDeclared(
            at=T, domain="a", spec=TrainingSpec(slot="lora", gpu_index=0, command=["t"], checkpoint_dir="/c")
        ),
        AdmissionDecided(at=T, domain="a", name="x", gpu_index=0, admitted=True, vram_bytes=GiB),
        AdmissionDecided(at=T, domain="a", name="y", gpu_index=0, admitted=False, vram_bytes=GiB, short_by_bytes=5),
        AdmissionDecided(at=T, domain="a", name="gone", gpu_index=0, admitted=True, vram_bytes=GiB),
        AdmissionDecided(at=T, domain="a", kind="training", name="lora", gpu_index=0, admitted=True, vram_bytes=GiB),
        ModelRetired(at=T, domain="a", model="gone"),
    ]
    slots = fold_declarations("f", "b", events)
    assert slots is not None and slots.admitted_models == []  # declared on b but never admitted there
    slots = fold_declarations("f", "a", events)
    assert [m.name for m in slots.admitted_models] == ["x"]
    assert slots.not_admitted == {"y": 5}
    assert [t.slot for t in slots.admitted_training] == ["lora"]
    assert slots.policy.probe_interval_ms == 123 and slots.first_domain == "a" and slots.source == "declared"
    assert fold_declarations("f", "c", events) is None


def test_gpu_observations_only_on_change():
    last = GpuObserved(
        at=T,
        domain="a",
        index=0,
        present=True,
        memory_total_bytes=24 * GiB,
        memory_used_bytes=4 * GiB,
        processes=[GpuProcess(pid=10, used_bytes=4 * GiB)],
    )
    same = GpuReading(
        index=0,
        present=True,
        memory_total_bytes=24 * GiB,
        memory_used_bytes=4 * GiB + GPU_USED_THRESHOLD - 1,
        processes=[GpuProcess(pid=10, used_bytes=4 * GiB)],
    )
    assert not _gpu_changed(last, same)
    assert _gpu_changed(last, GpuReading(index=0, present=False))
    assert _gpu_changed(
        last,
        GpuReading(
            index=0,
            present=True,
            memory_total_bytes=24 * GiB,
            memory_used_bytes=4 * GiB + GPU_USED_THRESHOLD,
            processes=same.processes,
        ),
    )
    assert _gpu_changed(
        last,
        GpuReading(
            index=0,
            present=True,
            memory_total_bytes=24 * GiB,
            memory_used_bytes=4 * GiB,
            processes=[GpuProcess(pid=11, used_bytes=4 * GiB)],
        ),
    )


def test_training_env_adds_the_contracts_variables_and_pci_bus_order():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "X": "1"}
    spec = TrainingSpec(slot="lora", gpu_index=1, command=["t"], checkpoint_dir="/ckpt/lora")
    env = training_env(base, spec)
    # HARU_GPU_INDEX is NVML's (PCI bus) order: CUDA must number the cards the same way, or a trainer
    # pinning CUDA_VISIBLE_DEVICES=$HARU_GPU_INDEX lands on another card on a mixed-GPU host.
    assert env == {
        **base,
        "HARU_CHECKPOINT_DIR": "/ckpt/lora",
        "HARU_GPU_INDEX": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert training_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, spec)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert base == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "X": "1"}  # not mutated


def test_restart_backoff_doubles_and_caps():
    from haru.agents.supervisor import backoff_s

    policy = Policy(restart_backoff_ms=1000, restart_backoff_max_ms=5000)
    assert [backoff_s(policy, n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_the_config_is_inline_json_or_a_path_and_the_environment_names_it(tmp_path):
    """Haru's supervisor took its config as inline JSON or a path (HARU_SUPERVISOR_CONFIG): so does the agent."""
    from haru.agents.config import config_from_env

    doc = {"fleet": "f", "domain": "a"}
    inline = load_config(json.dumps(doc))
    path = tmp_path / "host.json"
    path.write_text(json.dumps(doc))
    assert inline == load_config(str(path)) and (inline.fleet, inline.domain) == ("f", "a")
    assert config_from_env({"HARU_AGENT_CONFIG": str(path)}) == str(path)
    assert config_from_env({"HARU_SUPERVISOR_CONFIG": json.dumps(doc)}) == json.dumps(doc)
    assert config_from_env({"HARU_AGENT_CONFIG": "a.json", "HARU_SUPERVISOR_CONFIG": "b.json"}) == "a.json"
    assert config_from_env({}) == ""
    with pytest.raises(ConfigError, match="inline agent config"):
        load_config('{"fleet": "f"}')
