"""Subjects and the event catalogue: names are validated, model ids escape reversibly, bodies decode with paths."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from haru.core import events as ev
from haru.core import subjects
from haru.core.errors import EventDecodeError, InvalidName

NOW = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)


@given(st.text(min_size=1, max_size=60).filter(lambda s: not any(c.isspace() for c in s)))
def test_model_token_round_trips_and_is_a_single_safe_token(model_id):
    token = subjects.model_token(model_id)
    assert subjects.model_from_token(token) == model_id
    assert not set(token) & set(".*> \t\r\n")
    assert token.isascii()


@given(
    st.text(min_size=1, max_size=20).filter(lambda s: not any(c.isspace() for c in s)),
    st.text(min_size=1, max_size=20).filter(lambda s: not any(c.isspace() for c in s)),
)
def test_two_model_ids_never_share_a_token(a, b):
    if a != b:
        assert subjects.model_token(a) != subjects.model_token(b)


def test_readable_tokens_for_real_ids():
    assert subjects.model_token("qwen3.6:27b") == "qwen3~2e6~3a27b"
    assert subjects.model_token("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama~2f~4clama-3~2e1-8~42-~49nstruct"
    assert subjects.model("default", "a", "qwen3.6:27b") == "haru.evt.default.a.model.qwen3~2e6~3a27b"
    # case matters: ids are matched exactly as clients send them
    assert subjects.model_token("Qwen") != subjects.model_token("qwen")


@pytest.mark.parametrize(
    "kind,value,fragment",
    [
        ("fleet", "", "empty"),
        ("fleet", "Default", "did you mean 'default'"),
        ("domain", "a.b", "'.'"),
        ("domain", "a b", "' '"),
        ("slot", "x" * 65, "limit is 64"),
        ("domain", "decl", "reserved"),
        ("fleet", "prod>", "'>'"),
    ],
)
def test_bad_names_say_which_and_why(kind, value, fragment):
    with pytest.raises(InvalidName) as err:
        subjects.check_name(kind, value)
    assert kind in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize("bad", ["", "a b", "tab\tid", "x" * 300])
def test_bad_model_ids_are_refused(bad):
    with pytest.raises(InvalidName):
        subjects.model_token(bad)


def test_every_subject_parses_back():
    cases = {
        subjects.decl("f"): ("decl", "", ""),
        subjects.route("f"): ("route", "", ""),
        subjects.op("f"): ("op", "", ""),
        subjects.agent("f", "a"): ("agent", "a", ""),
        subjects.liveness("f", "a"): ("liveness", "a", ""),
        subjects.model("f", "a", "Qwen/Qwen3-4B"): ("model", "a", "Qwen/Qwen3-4B"),
        subjects.gpu("f", "a", 3): ("gpu", "a", ""),
        subjects.training("f", "a", "lora"): ("training", "a", ""),
    }
    for subject, (kind, domain, model) in cases.items():
        where = subjects.parse(subject)
        assert (where.fleet, where.kind, where.domain, where.model) == ("f", kind, domain, model)
    assert subjects.parse(subjects.gpu("f", "a", 3)).gpu_index == 3
    assert subjects.parse(subjects.training("f", "a", "lora")).slot == "lora"
    with pytest.raises(InvalidName):
        subjects.parse("haru.route.f")


def test_read_is_the_one_parser_and_keeps_the_fleet_of_a_malformed_event_subject():
    model = subjects.model("f", "a", "Qwen/Qwen3-4B")
    got = subjects.read(model)
    assert got.fleet == "f" and got.level == "" and got.where == subjects.parse(model) and not got.problem
    assert subjects.read(model) is got  # memoized
    assert subjects.read(subjects.op("f")).level == "op" and subjects.where(subjects.op("f")).kind == "op"
    # a subject under haru.evt.<fleet> that is no event subject: its fleet still counts it (the fold
    # reports it there as misplaced), but it addresses nothing, and says why
    bogus = subjects.read("haru.evt.f.a.bogus")
    assert bogus.fleet == "f" and bogus.where is None and "not a Haru event subject" in bogus.problem
    for other in ("haru.route.f", "haru.evt.f", "x.evt.f.decl", ""):
        assert subjects.fleet_of(other) == "" and subjects.where(other) is None, other
        assert subjects.read(other).problem, other


def test_heartbeat_of_reads_fleet_and_domain_back():
    assert subjects.heartbeat_of(subjects.heartbeat("f", "a")) == ("f", "a")
    for other in ("haru.hb.f", "haru.hb.f.a.b", "haru.alive.promoter.x", subjects.agent("f", "a")):
        assert subjects.heartbeat_of(other) is None, other


def test_alive_of_reads_role_and_id_back_from_the_subject():
    assert subjects.alive_of(subjects.alive("promoter", "promoter:host-a.eu")) == ("promoter", "promoter:host-a.eu")
    for other in ("haru.alive.promoter", "haru.alive.gateway.x", "haru.alive.promoter.~zz", "haru.hb.f.a"):
        assert subjects.alive_of(other) is None, other


def test_a_beat_counts_for_whom_its_subject_names_whatever_its_body_says():
    from haru.host.alive import Heard

    heard = Heard()
    heard.heard(subjects.alive("projector", "p1"))  # a body claiming to be a promoter is not read
    assert heard.alive("promoter") == [] and heard.alive("projector") == ["p1"]


def test_events_round_trip_with_stable_tags():
    e = ev.ModelLost(at=NOW, domain="a", model="qwen3.6:27b", reason="gpu_detached", detail="nvml: gpu lost")
    body = ev.encode(e)
    assert b'"type":"model_lost"' in body
    assert ev.decode(body) == e
    assert ev.tag_of(e) == "model_lost"
    assert len(set(ev.ALL_TAGS)) == len(ev.ALL_TAGS)


def test_a_body_that_is_not_an_event_says_where():
    with pytest.raises(EventDecodeError) as err:
        ev.decode(b'{"type":"model_lost","at":"2026-11-29T03:00:00Z","domain":"a","model":"m","reason":"bored"}')
    assert "$.reason" in str(err.value)
    with pytest.raises(EventDecodeError) as err:
        ev.decode(b'{"type":"no_such_event","at":"2026-11-29T03:00:00Z"}')
    assert "no_such_event" in str(err.value)
    with pytest.raises(EventDecodeError, match="malformed JSON"):
        ev.decode(b"{not json")


def test_new_fields_have_defaults_so_old_bodies_still_decode():
    old = b'{"type":"model_resident","at":"2026-11-29T03:00:00Z","domain":"a","model":"m"}'
    e = ev.decode(old)
    assert isinstance(e, ev.ModelResident) and e.warmup_ms == 0 and e.prev == "" and e.v == 1
