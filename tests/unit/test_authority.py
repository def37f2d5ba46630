"""The subject is the authority: the placement table and its check. Given an event and a subject,
then placed or misplaced (and why). Pure, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from haru.core import authority
from haru.core import events as ev
from haru.core import subjects as sj
from tests.support.authority import build

EVENT_TYPES: tuple[type, ...] = ev.AnyEvent.__args__  # type: ignore[attr-defined]
KINDS = (
    "decl",
    "route",
    "checkpoint",
    "weights",
    "op",
    "agent",
    "liveness",
    "model",
    "gpu",
    "training",
    "integrity",
    "domain_integrity",
    "usage",
)


def subject_of(
    kind: str,
    *,
    fleet: str = "default",
    domain: str = "a",
    model: str = "qwen3.6:27b",
    index: int = 0,
    slot: str = "lora",
) -> str:
    """The subject of `kind` for these names, built by `haru.core.subjects` (the production builders)."""
    return {
        "decl": lambda: sj.decl(fleet),
        "route": lambda: sj.route(fleet),
        "checkpoint": lambda: sj.checkpoint(fleet),
        "weights": lambda: sj.weights(fleet),
        "op": lambda: sj.op(fleet),
        "agent": lambda: sj.agent(fleet, domain),
        "liveness": lambda: sj.liveness(fleet, domain),
        "model": lambda: sj.model(fleet, domain, model),
        "gpu": lambda: sj.gpu(fleet, domain, index),
        "training": lambda: sj.training(fleet, domain, slot),
        "integrity": lambda: sj.integrity(fleet),
        "domain_integrity": lambda: sj.domain_integrity(fleet, domain),
        "usage": lambda: sj.usage(fleet),
    }[kind]()


# ------------------------------------------------------------------------------------- the table


def test_every_event_type_has_exactly_one_place():
    placed = [cls for p in authority.PLACES for cls in p.events]
    assert sorted(placed, key=lambda c: c.__name__) == sorted(EVENT_TYPES, key=lambda c: c.__name__)
    assert len(placed) == len(set(placed)), "an event type is allowed on two subject kinds"
    assert [p.kind for p in authority.PLACES] == list(KINDS)
    assert authority.kind_of(ev.RouteMoved) == "route" and authority.kind_of(int) == ""


def test_the_table_names_the_subjects_the_builders_make():
    for place in authority.PLACES:
        built = subject_of(place.kind, fleet="f", domain="d", model="m", index=3, slot="s")
        pattern = (
            place.subject.replace("<fleet>", "f")
            .replace("<domain>", "d")
            .replace("<model>", "m")
            .replace("<index>", "3")
            .replace("<slot>", "s")
        )
        assert built == pattern
        assert sj.parse(built).kind == place.kind


def test_only_the_promoter_writes_the_route_and_only_agents_their_domains():
    assert authority.writers_of("route") == ("promoter",)
    assert authority.writers_of("liveness") == ("promoter",)
    for kind in ("agent", "model", "gpu", "training", "domain_integrity"):
        assert authority.writers_of(kind) == ("agent",)
    assert "agent" not in authority.writers_of("op") + authority.writers_of("decl")


# ------------------------------------------------------------------------ given / when / then


def test_route_moved_is_placed_only_on_the_route_subject():
    moved = build(ev.RouteMoved, domain="b", by="agent:default/a")
    assert authority.misplaced(sj.route("default"), moved) == ""
    for kind in KINDS:
        if kind != "route":
            why = authority.misplaced(subject_of(kind), moved)
            assert "route_moved belongs on haru.evt.<fleet>.route (written by promoter)" in why, kind
            assert f"not on {authority.PLACES[KINDS.index(kind)].subject}" in why


def test_a_model_lost_naming_another_domain_on_my_model_subject_is_misplaced():
    lost = build(ev.ModelLost, domain="b", by="agent:default/a")
    subject = sj.model("default", "a", "qwen3.6:27b")
    why = authority.misplaced(subject, lost)
    assert why == "its body says domain 'b', its subject says 'a'"
    line = authority.anomaly(41, subject, lost, why)
    assert line == f"seq 41: model_lost on {subject} by agent:default/a not applied: {why}"


@pytest.mark.parametrize(
    "subject, event, said",
    [
        (sj.model("default", "a", "x"), build(ev.ModelResident, model="y"), "model 'y', its subject says 'x'"),
        (sj.gpu("default", "a", 0), build(ev.GpuObserved, index=1), "GPU index 1, its subject says 0"),
        (sj.training("default", "a", "lora"), build(ev.TrainingStarted, slot="other"), "slot 'other'"),
        (sj.liveness("default", "a"), build(ev.DomainUnreachable, domain="b"), "domain 'b'"),
        (sj.agent("default", "a"), build(ev.AgentStarted, domain="b"), "domain 'b'"),
        (sj.decl("default"), build(ev.FleetDeclared, fleet="prod"), "fleet 'prod', its subject says 'default'"),
    ],
)
def test_a_body_naming_other_things_than_its_subject_is_misplaced(subject, event, said):
    assert said in authority.misplaced(subject, event)


def test_what_a_subject_does_not_name_is_not_checked():
    # A declaration names any domain of its fleet; training runs on any GPU of its domain.
    assert authority.misplaced(sj.decl("default"), build(ev.ModelDeclared, domain="zz")) == ""
    assert authority.misplaced(sj.training("default", "a", "lora"), build(ev.TrainingStarted, index=7)) == ""
    assert authority.misplaced(sj.op("default"), build(ev.EligibilityChanged, domain="b")) == ""


def test_a_model_id_with_escapes_is_compared_as_the_id():
    model = "meta-llama/Llama-3.1-8B-Instruct"
    assert authority.misplaced(sj.model("default", "a", model), build(ev.ModelLoading, model=model)) == ""
    assert authority.misplaced(sj.model("default", "a", model), build(ev.ModelLoading, model=model.lower()))


def test_something_that_is_not_an_event_subject_holds_no_event():
    assert "not a Haru event subject" in authority.misplaced("haru.evt.default.a.bogus", build(ev.AgentStarted))
    assert "not a Haru event subject" in authority.misplaced("haru.evt.default.a.model.~zz", build(ev.ModelLost))
    assert sj.where("haru.evt.default.a.bogus") is None


# ----------------------------------------------------------------------------------- properties

names = st.from_regex(r"[a-z0-9_-]{1,12}", fullmatch=True).filter(
    lambda n: n not in ("decl", "route", "op", "checkpoint", "weights", "integrity", "usage")
)
model_ids = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    cls=st.sampled_from(EVENT_TYPES),
    kind=st.sampled_from(KINDS),
    fleet=names,
    domain=names,
    model=model_ids,
    index=st.integers(0, 16),
    slot=names,
)
def test_an_event_built_for_a_subject_stands_exactly_on_its_kind(cls, kind, fleet, domain, model, index, slot):
    names_ = dict(fleet=fleet, domain=domain, model=model, index=index, slot=slot)
    event = build(cls, **names_)
    subject = subject_of(kind, **names_)
    why = authority.misplaced(subject, event)
    assert (why == "") == (kind == authority.ALLOWED[cls]), why


@settings(max_examples=300, deadline=None)
@given(cls=st.sampled_from(EVENT_TYPES), data=st.data())
def test_a_body_that_names_anything_else_than_its_subject_is_misplaced(cls, data):
    kind = authority.ALLOWED[cls]
    mine = dict(fleet="f", domain="d", model="m", index=1, slot="s")
    carried = [
        k
        for k in ("fleet", "domain", "model", "index", "slot")
        if k in cls.__struct_fields__
        and k
        in {
            "decl": ("fleet",),
            "route": ("fleet",),
            "checkpoint": ("fleet",),
            "weights": ("fleet",),
            "op": ("fleet",),
            "agent": ("fleet", "domain"),
            "liveness": ("fleet", "domain"),
            "model": ("fleet", "domain", "model"),
            "gpu": ("fleet", "domain", "index"),
            "training": ("fleet", "domain", "slot"),
            "integrity": ("fleet",),
            "domain_integrity": ("fleet", "domain"),
            "usage": ("fleet",),
        }[kind]
    ]
    subject = subject_of(kind, **mine)
    assert authority.misplaced(subject, build(cls, **mine)) == ""
    if carried:
        field = data.draw(st.sampled_from(carried))
        other = dict(mine, **{field: 2 if field == "index" else mine[field] + "x"})
        assert authority.misplaced(subject, build(cls, **other)) != ""


def test_the_threat_model_carries_the_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert authority.table_markdown() in doc, "regenerate the table in docs/security.md from authority.table_markdown()"


def test_the_authority_and_the_fold_are_pure():
    import subprocess
    import sys

    code = (
        "import sys, haru.core.authority, haru.core.fold; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'asyncio', 'aiohttp', 'structlog', 'logging'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
