"""The promoter's provisioning runners: `launch` and `down` (through haru.provision's drivers).

Each returns the step's outcome event and is safe to run twice: a restarted promoter re-runs its own
started step, and a peer re-runs one whose lease ran out. `launch` names the cluster from the
operation (a `provision` launches the domain's base name, a `replace` the base name plus the
operation's six-hex generation), so a second run finds the first one's cluster with `sky status` and
does not launch again. `down` tears down every cluster (or service) of the domain that SkyPilot
lists, so a second run finds nothing left and completes.

What was spent is recorded in the step's detail: each launch attempt with its placement, outcome
and duration; each teardown with the region and SkyPilot's cost report for the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime

from haru.core.events import ClusterCost, StepCompleted, StepFailed
from haru.core.specs import DomainSpec
from haru.core.views import OperationView
from haru.provision import ProvisionError, SkyPilot, SkyServe
from haru.provision.errors import SkyTimeout
from haru.provision.execs import Exec
from haru.provision.skypilot import cluster_name, owns, provision_of

__all__ = ["Provisioning", "generation_of"]


def _now() -> datetime:
    return datetime.now(UTC)


def generation_of(op: OperationView) -> str:
    """The cluster generation an operation launches: '' for `provision` (the base name), the op id's
    last six hex digits for `replace`."""
    if op.kind != "replace":
        return ""
    tail = re.sub(r"[^0-9a-f]", "", op.op_id.lower())[-6:]
    return tail.rjust(6, "0")


def _old_regions(op: OperationView) -> tuple[str, ...]:
    """The regions this operation's `down` step found the failed host in (a replacement avoids them)."""
    out: list[str] = []
    for s in op.steps:
        if s.step == "down" and s.state == "completed":
            out += re.findall(r"\bregion ([A-Za-z0-9_.-]+)", s.detail)
    return tuple(out)


class Provisioning:
    """The `launch` and `down` step runners, over one `sky` (its path, exec seam and environment)."""

    def __init__(
        self, *, sky: str | list[str] = "sky", exec: Exec | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.skypilot = SkyPilot(exec, sky=sky, environ=environ)
        self.skyserve = SkyServe(exec, sky=sky, environ=environ)

    async def launch(
        self, fleet: str, spec: DomainSpec | None, op: OperationView, step: str
    ) -> StepCompleted | StepFailed:
        if spec is None:
            return StepFailed(
                at=_now(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code="not_declared",
                error=f"domain {op.target} is not declared",
            )
        generation = generation_of(op)
        try:
            p = provision_of(spec)
            if spec.provider == "skyserve":
                served = await self.skyserve.up(fleet, spec, generation=generation)
                how = "found already submitted" if served.found else "submitted"
                return StepCompleted(
                    at=_now(),
                    op_id=op.op_id,
                    step=step,  # type: ignore[arg-type]
                    detail=f"service {served.service} {how} (sky serve up); endpoint "
                    f"{served.endpoint or 'not yet known'}; took {served.duration_s:.1f} s",
                )
            result = await self.skypilot.launch(fleet, spec, generation=generation, avoid=_old_regions(op))
        except ProvisionError as exc:  # LaunchFailed, a timeout, sky missing, a secret missing...
            code = "launch_timeout" if isinstance(exc, SkyTimeout) else "launch_failed"
            return StepFailed(at=_now(), op_id=op.op_id, step=step, error_code=code, error=str(exc))  # type: ignore[arg-type]
        attempts = "; ".join(f"{a.placement.describe()}: {a.outcome} {a.duration_s:.1f} s" for a in result.attempts)
        what = "found already UP (not launched again)" if result.found else f"launched in {result.placement.describe()}"
        spot = "spot" if p.use_spot else "on-demand"
        return StepCompleted(
            at=_now(),
            op_id=op.op_id,
            step=step,  # type: ignore[arg-type]
            detail=f"cluster {result.cluster} {what}, {p.accelerators or 'no accelerator named'} "
            f"{spot}; attempts: {attempts}; took {result.duration_s:.1f} s",
        )

    async def down(
        self, fleet: str, spec: DomainSpec | None, op: OperationView, step: str
    ) -> StepCompleted | StepFailed:
        if spec is None:
            return StepFailed(
                at=_now(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code="not_declared",
                error=f"domain {op.target} is not declared",
            )
        try:
            p = provision_of(spec)
            done: list[str] = []
            costs: list[ClusterCost] = []  # what each cluster cost: the accounting's prices (docs/cost.md)
            if spec.provider == "skyserve":
                for s in await self.skyserve.services(timeout_s=p.status_timeout_s):
                    if owns(fleet, spec, s.name):
                        await self.skyserve.down(
                            s.name, timeout_s=p.down_timeout_s, status_timeout_s=p.status_timeout_s
                        )
                        done.append(f"service {s.name} (was {s.status})")
            else:
                for c in await self.skypilot.clusters(timeout_s=p.status_timeout_s):
                    if not owns(fleet, spec, c.name):
                        continue
                    report = await self.skypilot.cost_report(c.name, timeout_s=p.status_timeout_s)
                    await self.skypilot.down(c.name, timeout_s=p.down_timeout_s, status_timeout_s=p.status_timeout_s)
                    where = f"region {c.region}, " if c.region else ""
                    if report is not None:
                        costs.append(report)
                    spent = (
                        f"cost ${float(report.total):.2f} per SkyPilot's cost report"
                        if report is not None
                        else "cost not reported"
                    )
                    done.append(f"{c.name} ({where}{spent})")
        except ProvisionError as exc:  # TeardownFailed, a timeout, sky missing...
            return StepFailed(
                at=_now(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                error_code="teardown_failed",
                error=str(exc),
            )
        if not done:
            return StepCompleted(
                at=_now(),
                op_id=op.op_id,
                step=step,  # type: ignore[arg-type]
                detail=f"nothing to tear down: SkyPilot lists no cluster of {cluster_name(fleet, spec)}",
            )
        return StepCompleted(
            at=_now(),
            op_id=op.op_id,
            step=step,  # type: ignore[arg-type]
            detail="tore down " + "; ".join(done),
            costs=costs,
        )
