"""`haru status` as text: a pure function of a `FleetView` and the reader's clock.

    print(render(view, now))

hearth's format, per domain and GPU:

    fleet default  ·  route revision 1234 → a  ·  view seq 1240
    a  ◀ active (route revision 1234)  ·  static  ·  http://10.0.0.1:9000  ·  agent up on gpu-a  ·  reachable
      GPU 0 (A6000): 42.0 / 44.2 GiB held  (5 declared, 2 admitted)
        muse-local:latest            resident for 14203s
        deepseek-r1:32b              loading for 47s
        gemma4:26b                   not admitted — short by 14.8 GiB
      training lora (GPU 0)          running for 300s (pid 4242)

`held` is the VRAM of the admitted models on that GPU; the second figure is what can be planned
into: the declared memory minus the reserve (hearth's "44.2 GiB"). The per-line formats come from
`haru.core.planner` (`format_gib`, `gpu_summary_line`), so `haru apply` and `haru status` agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from haru.core import ranking
from haru.core.planner import gpu_summary_line, shortfall_text
from haru.core.residency import (
    Answer,
    Failed,
    Loading,
    Lost,
    NotAdmitted,
    Pulling,
    Resident,
    Sleeping,
    Stopped,
    Unknown,
    Waking,
)
from haru.core.sizes import GiB, format_gib, format_size
from haru.core.views import (
    DomainView,
    FleetView,
    GpuView,
    ModelView,
    OperationView,
    RankedStandby,
    RouteIntent,
    Target,
    TrainingView,
)
from haru.core.weights import lines as weight_lines

__all__ = ["answer_text", "model_line", "model_state", "render", "render_intent", "standby_lines", "training_state"]

WIDTH = 28
_WHOSE = {
    "gpu_detached": "provider",
    "evicted": "over-committed",
}


def _secs(since: datetime | None, now: datetime) -> str:
    if since is None:
        return "?s"
    return f"{max(0, int((now - since).total_seconds()))}s"


def model_state(model: ModelView, now: datetime) -> str:
    """`resident for 14203s`, `loading for 47s`, `not admitted — short by 14.8 GiB`, `asleep`..."""
    s = model.residency
    if model.admitted is False or isinstance(s, NotAdmitted):
        short = s.short_by_bytes if isinstance(s, NotAdmitted) and s.short_by_bytes else model.short_by_bytes
        return f"not admitted — {shortfall_text(short, model.short_of)}"
    if isinstance(s, Resident):
        return f"resident for {_secs(s.since, now)}"
    if isinstance(s, Pulling):
        of = f" {format_size(s.done_bytes)} of {format_size(s.total_bytes)}" if s.total_bytes else ""
        return f"pulling {s.reference}{of} for {_secs(s.since, now)}"
    if isinstance(s, Loading):
        extra = f" (attempt {s.attempt})" if s.attempt > 1 else ""
        if s.waiting_for:
            extra += f" — waiting for {s.waiting_for}"
        return f"loading for {_secs(s.since, now)}{extra}"
    if isinstance(s, Waking):
        return f"waking for {_secs(s.since, now)}"
    if isinstance(s, Sleeping):
        return "asleep" if s.level == 1 else f"asleep (level {s.level})"
    if isinstance(s, Lost):
        text = f"lost: {s.reason.replace('_', ' ')}"
        whose = _WHOSE.get(s.reason)
        if whose:
            text += f" ({whose})"
        if s.detail:
            text += f" — {s.detail}"
        return text
    if isinstance(s, Failed):
        return f"failed: {s.runtime_said}" if s.runtime_said else "failed"
    if isinstance(s, Stopped):
        return f"stopped — {s.detail}" if s.detail else "stopped"
    if isinstance(s, Unknown):
        return "unknown (never probed)" if model.admitted else "unknown (not planned yet)"
    return type(s).__name__.lower()  # pragma: no cover - every state is named above


def model_line(model: ModelView, now: datetime) -> str:
    return f"{model.name:<{WIDTH}} {model_state(model, now)}"


def training_state(slot: TrainingView, now: datetime) -> str:
    if slot.admitted is False:
        return f"not admitted — {shortfall_text(slot.short_by_bytes, slot.short_of)}"
    if slot.running:
        return f"running for {_secs(slot.since, now)} (pid {slot.pid})"
    if slot.last_stop:
        code = f", exit {slot.last_exit_code}" if slot.last_exit_code is not None else ""
        return f"stopped: {slot.last_stop}{code}, {_secs(slot.since, now)} ago"
    return "idle"


def _capacity(gpu: GpuView) -> int:
    if gpu.memory_bytes:
        return max(0, gpu.memory_bytes - gpu.reserve_bytes)
    return gpu.memory_total_bytes


def host_ram_line(d: DomainView) -> str:
    """`host RAM 94.0 / 224.0 GiB held  (2 sleeping models, 1 training slot)  · 31.2 of 251.5 GiB used at agent
    start`: what the plan books in host RAM on the standby (sleeping weights, trainers) against host RAM minus
    its reserve, and what /proc/meminfo said when the agent started. '' when neither is known."""
    parts = []
    if d.host_ram_bytes:
        models = [m for m in d.models.values() if m.admitted and m.host_ram_bytes]
        slots = [t for t in d.training.values() if t.admitted and t.host_ram_bytes]
        held = sum(m.host_ram_bytes for m in models) + sum(t.host_ram_bytes for t in slots)
        capacity = max(0, d.host_ram_bytes - d.host_ram_reserve_bytes)
        parts.append(
            f"host RAM {held / GiB:.1f} / {format_gib(capacity)} held  ({len(models)} sleeping model"
            f"{'s' if len(models) != 1 else ''}, {len(slots)} training slot{'s' if len(slots) != 1 else ''})"
        )
    a = d.agent
    if a.host_ram_total_bytes:
        used = max(0, a.host_ram_total_bytes - a.host_ram_available_bytes)
        parts.append(
            f"{'' if parts else 'host RAM '}{used / GiB:.1f} of {format_gib(a.host_ram_total_bytes)} used at "
            f"agent start"
        )
    return "  · ".join(parts)


def _gpu_line(gpu: GpuView, models: list[ModelView], spanned: Sequence[ModelView] = ()) -> str:
    # a model across GPUs is listed under its first GPU and booked on each (`spanned` here)
    held = sum(m.vram_bytes for m in models if m.admitted) + sum(m.vram_bytes for m in spanned if m.admitted)
    admitted = sum(1 for m in models if m.admitted)
    name = f" ({gpu.name})" if gpu.name else ""
    line = f"GPU {gpu.index}{name}: " + gpu_summary_line(held, _capacity(gpu), len(models), admitted)
    if gpu.present is False:
        line += "  — NOT PRESENT (detached by the provider)"
    elif gpu.present is True and gpu.memory_total_bytes:
        line += f"  · {format_gib(gpu.memory_used_bytes)} used now"
    elif gpu.present is None and gpu.observed_at is not None:
        line += "  · presence unknown (no NVML)"
    return line


def accounting_lines(gpu: GpuView) -> list[str]:
    """The anomalies of a GPU's per-process accounting: whoever holds more than planned, and foreign usage.

    `OVER PLAN  qwen3-8b holds 9.5 GiB, planned 7.0 GiB (pids 4242, 4250)`
    `FOREIGN    pid 9001 holds 2.0 GiB (a process Haru did not start)`
    """
    if gpu.present is not True:
        return []
    lines = []
    for u in gpu.usage:
        if u.over_plan:
            what = u.name if u.kind == "model" else f"training {u.name}"
            pids = ", ".join(map(str, u.pids))
            lines.append(
                f"OVER PLAN  {what} holds {format_gib(u.used_bytes)}, planned {format_gib(u.planned_bytes)}"
                f" (pid{'s' if len(u.pids) != 1 else ''} {pids})"
            )
    for p in gpu.foreign:
        lines.append(f"FOREIGN    pid {p.pid} holds {format_gib(p.used_bytes)} (a process Haru did not start)")
    return lines


def _domain_header(view: FleetView, d: DomainView, now: datetime, ranks: dict[str, int] | None = None) -> str:
    parts = [d.name]
    if d.name == view.active:
        parts[0] += f"  ◀ active (route revision {view.route_revision})"
    elif view.active:
        rank = (ranks or {}).get(d.name, 0)
        parts[0] += f"  (standby #{rank})" if rank and len(view.domains) > 2 else "  (standby)"
    parts.append(d.provider + (f" {d.region}" if d.region else ""))
    url = d.serving_url or d.agent.serving_url
    if url:
        parts.append(url + ("  (serve: direct)" if d.serve == "direct" else ""))
    if d.agent.running:
        parts.append(f"agent up on {d.agent.host or '?'} for {_secs(d.agent.since, now)}")
    elif d.agent.since is not None:
        parts.append(f"agent stopped {_secs(d.agent.since, now)} ago")
    else:
        parts.append("no agent yet")
    if d.reachable is True:
        parts.append("reachable")
    elif d.reachable is False:
        parts.append(f"UNREACHABLE for {_secs(d.reachability_since, now)}")
    if not d.eligible:
        age = f" for {_secs(d.eligibility_since, now)}" if d.eligibility_since is not None else ""
        parts.append(f"ineligible{age}: {d.ineligible_why or 'no reason given'}")
    if d.signalled:  # a preemption notice, a critical XID or an ECC fault, until its agent starts again
        age = f" {_secs(d.signalled_at, now)} ago" if d.signalled_at is not None else ""
        parts.append(f"ABOUT TO GO (signalled{age}): {d.signalled}")
    return "  ·  ".join(parts)


def _operation(op: OperationView, now: datetime, *, finished: bool) -> str:
    head = f"{op.kind} of {op.target}"
    if op.source:
        head += f" over {op.source}"
    head += f" ({op.op_id}, {op.reason}"
    head += f", {op.detail})" if op.detail else ")"
    if finished:
        head += f": {op.state}"
        if op.finished_at is not None:
            head += f" {_secs(op.finished_at, now)} ago"
        if op.error:
            head += f" — {op.error}"
    else:
        head += f", running for {_secs(op.requested_at, now)}"
    steps = [
        f"{s.step}{'' if s.attempt == 1 else f'#{s.attempt}'} {s.state}"
        + (f" ({s.detail})" if s.state == "skipped" else "")
        for s in op.steps
    ]
    if op.tried:
        head += "\n    tried first: " + ", ".join(
            f"{t.target} ({t.step} failed: {t.error})" if t.error else t.target for t in op.tried
        )
    if steps:
        head += "\n    steps: " + ", ".join(steps)
    return head


def standby_lines(ranked: Sequence[RankedStandby], protection: str) -> list[str]:
    """The ranking, best first, and whether the fleet is protected:

    standbys: 1 of 2 fit (protected)
      1. b  fit; declared 1st in the layout; last wake 830 ms
      2. c  not fit: standby c is unreachable; declared 2nd in the layout; wake never measured
    """
    if not ranked:
        return []
    fit = sum(1 for r in ranked if r.fit)
    if protection == "unprotected":
        head = f"standbys: none of {len(ranked)} fit: UNPROTECTED (one more failure of the active and nothing serves)"
    else:
        head = f"standbys: {fit} of {len(ranked)} fit" + (f" ({protection})" if protection else "")
    return [head, *(f"  {r.rank}. {r.domain}  {r.why}" for r in ranked)]


def anomaly_line(view: FleetView, now: datetime) -> str:
    """The log's anomalies: how many in all, the last with its age, and whether its cause is over."""
    age = f", {_secs(view.last_anomaly_at, now)} ago" if view.last_anomaly_at is not None else ""
    if view.anomaly_cleared_at is not None:
        return (
            f"anomalies in the log: {view.anomalies} (none open: the last{age}, about {view.anomaly_about}, "
            f"cleared {_secs(view.anomaly_cleared_at, now)} ago: {view.last_anomaly})"
        )
    return f"anomalies in the log: {view.anomalies} (last{age}: {view.last_anomaly})"


def render(view: FleetView, now: datetime) -> str:
    """The whole status of one fleet, as lines of text (no trailing newline)."""
    lines: list[str] = []
    head = f"fleet {view.fleet}"
    if view.active:
        head += f"  ·  route revision {view.route_revision} → {view.active}"
    else:
        head += "  ·  not routed yet (no route_moved)"
    head += f"  ·  view seq {view.seq}"
    if view.updated_at is not None:
        head += f" ({_secs(view.updated_at, now)} ago)"
    lines.append(head)
    if view.active and view.active not in view.domains:
        lines.append(f"  the route points at {view.active!r}, which is not declared")
    if not view.domains:
        lines.append("  no domains declared (run `haru apply`)")
    ranked = ranking.rank(view) if view.active else []
    ranks = {r.domain: r.rank for r in ranked}
    for d in view.domains.values():
        lines.append(_domain_header(view, d, now, ranks))
        ram = host_ram_line(d)
        if ram:
            lines.append("  " + ram)
        by_gpu: dict[int, list[ModelView]] = {}
        for m in d.models.values():
            by_gpu.setdefault(m.gpu_index, []).append(m)
        gpus = list(d.gpus)
        known = {g.index for g in gpus}
        gpus += [GpuView(index=i) for i in sorted(by_gpu) if i not in known]
        for g in gpus:
            models = by_gpu.get(g.index, [])
            spanned = [m for m in d.models.values() if m.gpu_index != g.index and g.index in m.gpu_indexes]
            line = _gpu_line(g, models, spanned)
            if any(m.admitted for m in spanned):
                line += f"  (with {', '.join(m.name for m in spanned if m.admitted)} across GPUs)"
            lines.append("  " + line)
            for m in models:
                lines.append("    " + model_line(m, now))
            lines.extend("    " + line for line in accounting_lines(g))
        for t in d.training.values():
            label = f"training {t.slot} (GPU {t.gpu_index})"
            lines.append(f"  {label:<{WIDTH + 2}} {training_state(t, now)}")
    lines.extend(standby_lines(ranked, ranking.protection(view, ranked) if ranked else ""))
    if view.operation is not None:
        lines.append("operation in flight: " + _operation(view.operation, now, finished=False))
    if view.last_operation is not None:
        lines.append("last operation: " + _operation(view.last_operation, now, finished=True))
    if view.declined:
        age = f" {_secs(view.declined_at, now)} ago" if view.declined_at is not None else ""
        lines.append(f"failover declined{age}: {view.declined}")
    if view.active and (view.weights or view.model_weights or view.weights_change is not None):
        lines.extend(weights_lines(view, now))
    if view.anomalies:
        lines.append(anomaly_line(view, now))
    return "\n".join(lines)


# ------------------------------------------------------------------------------- route intents


def answer_text(a: Answer, now: datetime) -> str:
    """One router answer in words: `ready`, `warming for 47s`, `lost: gpu detached (provider)`."""
    if a.answer == "warming":
        secs = _secs(a.since, now) if a.since is not None else f"{a.for_ms // 1000}s"
        return f"warming for {secs}" + (f" ({a.reason})" if a.reason in ("waking", "pulling") else "")
    if a.answer == "lost":
        text = f"lost: {a.reason.replace('_', ' ')}"
        whose = _WHOSE.get(a.reason)
        if whose:
            text += f" ({whose})"
        if a.detail:
            text += f" — {a.detail}"
        return text
    if a.answer == "not_admitted":
        return f"not admitted — short by {format_gib(a.short_by_bytes)}"
    return a.answer


def _target_line(role: str, t: Target | None) -> str:
    if t is None:
        return f"{role:<8} none"
    parts = [f"{role:<8} {t.domain}"]
    if t.serving_url:
        parts.append(t.serving_url)
    if t.reachable is False:
        parts.append("unreachable")
    if t.degraded:
        parts.append("DEGRADED" + (f" since {t.degraded_since.isoformat()}" if t.degraded_since else ""))
    parts.append("eligible" if t.eligible else f"not eligible: {t.why}")
    if t.degraded and t.eligible and t.why:
        parts[-1] += f" ({t.why})"
    line = "  ".join(parts)
    for model, url in t.model_urls.items():
        line += f"\n{'':<9}{model} → {url}"
    return line


def weights_lines(view: FleetView, now: datetime) -> list[str]:
    """The splits in force and the last change (a canary rollback with its evidence)."""
    out = weight_lines(view.weights, view.model_weights, view.active)
    c = view.weights_change
    if c is not None:
        age = f" {_secs(c.at, now)} ago" if c.at is not None else ""
        what = "canary rolled back" if c.reason == "canary_rolled_back" else f"weights set ({c.reason})"
        out.append(f"last weights change{age}: {what} by {c.by or '?'} (seq {c.seq}): {c.detail}")
    return out


def render_intent(ri: RouteIntent, now: datetime) -> str:
    """`haru route`: a fleet's route intent as text."""
    head = f"fleet {ri.fleet}  ·  "
    if ri.revision and ri.active is not None:
        head += f"route revision {ri.revision} → {ri.active.domain}"
    else:
        head += "no active domain (never routed)"
    head += f"  ·  view seq {ri.view_seq}"
    lines = [head, _target_line("active", ri.active), _target_line("standby", ri.standby)]
    if len(ri.standbys) > 1 or ri.protection == "unprotected":
        lines.extend(standby_lines(ri.standbys, ri.protection))
    if ri.operation:
        lines.append(f"operation in flight: {ri.operation}")
    if ri.active is not None:
        lines.extend(weight_lines(ri.weights, ri.model_weights, ri.active.domain))
        for name, w in ri.weighted.items():
            ready = ", ".join(f"{m} {answer_text(a, now)}" for m, a in w.answers.items())
            lines.append(f"  {name}: {w.target.serving_url or '(no URL)'}  {ready}")
    if ri.answers:
        lines.append(f"answers on {ri.active.domain if ri.active else '?'}:")
        for model, a in ri.answers.items():
            lines.append(f"  {model:<{WIDTH}} {answer_text(a, now)}")
    return "\n".join(lines)
