"""The events of LoRA adapters served at run time (docs/adapters.md), beside `AdapterPublished` (a training
run's adapter, in `haru.core.events_domain`):

    haru.evt.<fleet>.<domain>.model.<base>   adapter_state_changed: one adapter version in that domain's
                                             runtime of the base model (loading, resident, failed, unloaded,
                                             not_admitted), written by that domain's agent
    haru.evt.<fleet>.weights                 adapter_routed: which version of an adapter takes its traffic
                                             (current, canary and its percent, previous) and why, written
                                             by the promoter (the probe gate, haru/promoter/adapter_gate.py)

Import them from `haru.core.events`, which re-exports these.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from haru.core.events_base import Event

__all__ = ["ADAPTER_STATES", "ROUTED_REASONS", "AdapterRouted", "AdapterState", "AdapterStateChanged"]

AdapterState = Literal["loading", "resident", "failed", "unloaded", "not_admitted"]
ADAPTER_STATES: tuple[str, ...] = ("loading", "resident", "failed", "unloaded", "not_admitted")

# Why an adapter's routing changed: its first version passed its probe and serves (`probe_passed`), a new
# version passed its probe and goes out as a canary (`canary_started`), a canary that kept passing takes all
# the traffic (`promoted`), a version failed its probe or its runtime (`rolled_back`), or an operator said so.
ROUTED_REASONS: tuple[str, ...] = ("probe_passed", "canary_started", "promoted", "rolled_back", "manual")


class AdapterStateChanged(Event, frozen=True, kw_only=True, tag="adapter_state_changed"):
    """One version of an adapter in this domain's runtime of its base model `model`, as the agent saw it:
    `loading` (fetched, digest checked, asked of the runtime), `resident` (the runtime holds it and it
    answered), `failed` (`detail`: the runtime's own words, or the fetch's), `unloaded` (on purpose: no longer
    wanted), `not_admitted` (`detail`: what the plan had no room for: `--max-loras`, the rank). On the base
    model's residency subject, which only this domain's agent writes."""

    domain: str
    model: str  # the base model (the subject's)
    adapter: str
    version: str
    state: AdapterState
    detail: str = ""
    runtime_name: str = ""  # the name the runtime serves it under (`<base>:<adapter>@<version>`)
    took_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Its evaluation probe (the layout's adapter_probes), asked on load: 'passed', 'failed', or '' (none
    # declared); `probe_detail` says which prompt answered what.
    probe: str = ""
    probe_detail: str = ""


class AdapterRouted(Event, frozen=True, kw_only=True, tag="adapter_routed"):
    """Which version of the adapter `<model>:<adapter>` takes its traffic: `current` ('' = none yet), a
    `canary` taking `percent` of it ('' = none), and `previous` (kept loaded, what a rollback returns to).
    `reason` is one of ROUTED_REASONS; `version` the version it is about; `detail` the evidence (the probe's
    prompts and answers, the runtime's words). Written only by the promoter, on the fleet's weights subject."""

    model: str  # the base model
    adapter: str
    current: str = ""
    canary: str = ""
    percent: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    previous: str = ""
    reason: str = "manual"
    version: str = ""
    detail: str = ""
