"""The pure parts of the console and the metrics: the operations fold, decline reasons, ports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from haru.core.errors import ConfigError
from haru.core.events import (
    OperationAborted,
    OperationCompleted,
    PromotionRequested,
    StepCompleted,
    StepFailed,
    StepStarted,
)
from haru.gateway.console_core import FLOWS, operations
from haru.host.metrics import metrics_address
from haru.log.eventlog import Record
from haru.promoter.metrics import DECLINE_REASONS, decline_reason

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def rec(seq: int, event) -> Record:
    return Record(seq=seq, subject="haru.evt.f.op", time_ns=0, data=b"", event=event)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def test_operations_fold_steps_with_wall_and_agent_durations_newest_first():
    records = [
        rec(1, PromotionRequested(at=at(0), op_id="op-1", target="b", source="a", reason="gpu_detached")),
        rec(2, StepStarted(at=at(10), op_id="op-1", step="stop_training")),
        rec(3, StepCompleted(at=at(60), op_id="op-1", step="stop_training", took_ms=40)),
        rec(4, StepStarted(at=at(70), op_id="op-1", step="verify_gpu")),
        rec(5, StepFailed(at=at(90), op_id="op-1", step="verify_gpu", error_code="gpu_gone", error="GPU 0 gone")),
        rec(6, OperationAborted(at=at(100), op_id="op-1", step="verify_gpu", error="GPU 0 gone")),
        rec(7, PromotionRequested(at=at(1000), op_id="op-2", target="b", reason="manual")),
        rec(8, StepStarted(at=at(1005), op_id="op-2", step="stop_training")),
        rec(9, OperationCompleted(at=at(3000), op_id="op-9")),  # another operation's: ignored
    ]
    ops = operations(records)
    assert [o["op_id"] for o in ops] == ["op-2", "op-1"]
    running, aborted = ops
    assert running["state"] == "running" and running["steps"][0]["state"] == "started"
    assert running["duration_ms"] is None
    assert aborted["state"] == "aborted" and aborted["duration_ms"] == 100
    assert aborted["error"] == "verify_gpu: GPU 0 gone"
    first, second = aborted["steps"]
    assert (first["step"], first["state"], first["duration_ms"], first["took_ms"]) == (
        "stop_training",
        "completed",
        50,
        40,
    )
    assert (second["state"], second["duration_ms"], second["error"]) == ("failed", 20, "gpu_gone: GPU 0 gone")


def test_flows_come_from_the_promoters_table():
    assert FLOWS["promotion"] == ["stop_training", "verify_gpu", "wake", "probe", "flip", "settle_old_active"]
    assert FLOWS["demotion"] == ["sleep", "start_training"]


@pytest.mark.parametrize(
    "why,label",
    [
        (
            "a unreachable (heartbeats silent) since 2026-11-30T12:00:00.000+00:00; standby b is unreachable",
            "standby_unreachable",
        ),
        ("GPU 0 of a detached; standby b's model m is lost: gpu_detached", "standby_model_lost"),
        ("GPU 0 of a detached; standby b's GPU 0 is detached", "standby_gpu_detached"),
        ("x; standby b's model m is loading", "standby_model_not_ready"),
        ("x; the last promotion onto b aborted (boom); retrying after 15000 ms", "backing_off"),
        ("x; no standby domain declared", "no_standby"),
        ("something new", "other"),
    ],
)
def test_decline_reasons_are_a_small_label_set(why, label):
    assert decline_reason(why) == label
    assert label == "other" or label in {v for _, v in DECLINE_REASONS}


def test_metrics_address_flag_over_env_and_errors_name_the_fix():
    assert metrics_address(None, None, {}) is None
    assert metrics_address(None, None, {}, default_port=9400) == ("127.0.0.1", 9400)
    assert metrics_address(None, None, {"HARU_METRICS_PORT": "9402", "HARU_METRICS_HOST": "0.0.0.0"}) == (
        "0.0.0.0",
        9402,
    )
    assert metrics_address(9403, "127.0.0.2", {"HARU_METRICS_PORT": "9402"}) == ("127.0.0.2", 9403)
    with pytest.raises(ConfigError, match="HARU_METRICS_PORT='x' is not a port number"):
        metrics_address(None, None, {"HARU_METRICS_PORT": "x"})
    with pytest.raises(ConfigError, match="out of range"):
        metrics_address(70000, None, {})


def test_held_bytes_counts_what_the_agents_children_hold_by_declaration():
    from types import SimpleNamespace as NS

    from haru.agents.metrics import foreign_of, held_bytes
    from haru.core.residency import Loading, Lost, Resident, Sleeping
    from haru.core.sizes import GiB
    from haru.core.specs import ModelSpec, Policy

    def model(name, vram, state, gpu=0, runtime="vllm"):
        spec = ModelSpec(name=name, slot="s", gpu_index=gpu, vram_bytes=vram * GiB, runtime=runtime, port=1)
        return NS(spec=spec, state=state, runtime=NS(kind=runtime))

    agent = NS(
        policy=Policy(sleep_residual_bytes=GiB // 2),
        models={
            "a": model("a", 2, Resident()),
            "b": model("b", 9, Sleeping()),
            "c": model("c", 10, Lost(reason="evicted")),
            "d": model("d", 3, Loading()),
            "e": model("e", 5, Resident(), gpu=1),
            "f": model("f", 4, Sleeping(), runtime="llama_server"),
        },
        trainers={
            "lora": NS(spec=NS(gpu_index=0, vram_bytes=8 * GiB), running=lambda: True),
            "idle": NS(spec=NS(gpu_index=0, vram_bytes=6 * GiB), running=lambda: False),
        },
    )
    # resident 2 + loading 3 + vLLM asleep 0.5 + llama-server asleep keeps all 4 + training 8; lost holds nothing
    assert held_bytes(agent.models, agent.trainers, agent.policy, 0) == 2 * GiB + 3 * GiB + GiB // 2 + 4 * GiB + 8 * GiB
    assert held_bytes(agent.models, agent.trainers, agent.policy, 1) == 5 * GiB

    assert foreign_of(NS(present=True)) is None  # this branch's observations carry no accounting
    assert foreign_of(NS(accounted=False, foreign=[NS(pid=1, used_bytes=5)])) is None
    assert foreign_of(NS(accounted=True, foreign=[NS(pid=1, used_bytes=5), NS(pid=2, used_bytes=7)])) == 12
    assert foreign_of(NS(accounted=True, foreign=[])) == 0
