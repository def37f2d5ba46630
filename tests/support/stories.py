"""A scripted story on a log: the `stories` model declared, loaded, resident and unloaded, as hearth's README
shows it, for the history and misplaced-event tests.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from haru.core import events as ev
from haru.core import subjects
from haru.core.specs import ModelSpec, Policy

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)


async def script_stories(log) -> dict[str, int]:
    """declared -> loading -> resident -> unloaded, as hearth's README shows for `stories`."""
    decl = subjects.decl("default")
    s = await log.append(decl, ev.FleetDeclared(at=T0, fleet="default", policy=Policy()), expect=0)
    model_declared = s = await log.append(
        decl,
        ev.ModelDeclared(
            at=T0,
            domain="a",
            spec=ModelSpec(name="stories", slot="main", gpu_index=0, runtime="llama_server", vram_bytes=1073741824),
        ),
        expect=s,
    )
    declared = s = await log.append(
        decl,
        ev.AdmissionDecided(
            at=T0, domain="a", name="stories", gpu_index=0, admitted=True, vram_bytes=1073741824, cause=model_declared
        ),
        expect=s,
    )
    m = subjects.model("default", "a", "stories")
    loading = await log.append(
        m,
        ev.ModelLoading(
            at=T0 + timedelta(seconds=1), domain="a", model="stories", endpoint="127.0.0.1:18080", pid=10121
        ),
        expect=0,
    )
    resident = await log.append(
        m,
        ev.ModelResident(
            at=T0 + timedelta(seconds=2),
            domain="a",
            model="stories",
            endpoint="127.0.0.1:18080",
            warmup_ms=256,
            cause=loading,
        ),
        expect=loading,
    )
    unloaded = await log.append(
        m, ev.ModelStopped(at=T0 + timedelta(seconds=3), domain="a", model="stories"), expect=resident
    )
    return {
        "model_declared": model_declared,
        "declared": declared,
        "loading": loading,
        "resident": resident,
        "unloaded": unloaded,
    }
