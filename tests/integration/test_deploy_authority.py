"""The shipped NATS permissions against the placement table (`haru.core.authority`), on the deploy cluster:
three nats-servers configured by the shipped files, every process logging in with the users
`gen_users.py` generates (the cluster and its helpers are test_deploy_cluster's).

1. Every role tries every subject kind of a fleet (its own domain's and another's): what the
   servers refuse is exactly what the table does not let that role write. Then every role appends
   every event type to every subject the servers let it write: what the table forbids is stored
   (the permissions are per subject, not per body) but no fold applies it and verify names it.
2. Agent a, with its own credentials, forges every event type on every subject it may write (a
   route move, b's models lost, b unreachable, a promotion of b, its steps, declarations...): with a
   promoter and a projector running under their own users, routing never moves, and the next
   genuine promotion probes b and flips the route.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import msgspec
import nats.errors
import nats.js.errors
import pytest

from haru.core import authority, subjects
from haru.core.events import AnyEvent, OperationCompleted, PromotionRequested, RouteMoved, StepCompleted
from haru.core.fold import fold
from haru.core.residency import Sleeping
from haru.core.views import intent_decoder
from haru.host.tasks import cancel_and_wait
from haru.log.apply import apply
from haru.log.history import Verifier, misplaced_records
from haru.log.requests import request_operation
from haru.projections.projector import Projector
from tests.support.authority import build
from tests.support.clock import now
from tests.support.cluster import haru_cli
from tests.support.promoter import op_events, promoters, route_moves, view_of, wait_op_end, wait_view
from tests.support.promoter_fake import FakeAgent, layout
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(120)

EVENT_TYPES: tuple[type, ...] = AnyEvent.__args__  # type: ignore[attr-defined]
ROLES = ("agent", "promoter", "projector", "gateway", "control", "operator", "sink", "router")
UNUSED_SEQ = "999999999"  # an expected sequence no subject has: a publish that reaches JetStream is refused by it


def role_writes(role: str, kind: str, domain: str, own_domain: str) -> bool:
    """What the table lets a NATS user write ('control' is promoter + projector + gateway in one)."""
    if role == "control":
        return any(role_writes(r, kind, domain, own_domain) for r in ("promoter", "projector", "gateway"))
    if role == "agent":
        return "agent" in authority.writers_of(kind) and domain == own_domain
    return role in authority.writers_of(kind)


def fleet_subjects(fleet: str, domains: tuple[str, ...], model: str = "m1", slot: str = "lora") -> list[str]:
    out = [
        subjects.decl(fleet),
        subjects.route(fleet),
        subjects.checkpoint(fleet),
        subjects.weights(fleet),
        subjects.op(fleet),
        subjects.integrity(fleet),
    ]
    for d in domains:
        out += [
            subjects.agent(fleet, d),
            subjects.liveness(fleet, d),
            subjects.model(fleet, d, model),
            subjects.gpu(fleet, d, 0),
            subjects.training(fleet, d, slot),
            subjects.domain_integrity(fleet, d),
        ]
    return out


def same_except_position(a, b) -> bool:
    """Two views equal but for where they are and what they counted (a misplaced event moves only those)."""
    skip = dict(
        seq=0,
        anomalies=0,
        last_anomaly="",
        decl_seq=0,
        op_seq=0,
        route_seq=0,
        weights_seq=0,
        updated_at=None,
        checkpoint=0,
    )
    return msgspec.structs.replace(a, **skip) == msgspec.structs.replace(b, **skip)


async def may_publish(cluster, user: str, subject_list: list[str]) -> dict[str, bool]:
    """Which subjects the servers let `user` publish to JetStream: a publish that reaches the stream
    is refused by it at once (wrong last sequence, nothing stored); one the permissions drop times out
    and the server says 'Permissions Violation'."""
    errors: list[str] = []
    nc = await cluster.raw(user, errors)
    try:
        js = nc.jetstream(timeout=2.0)

        async def probe(subject: str) -> bool:
            settle = time.monotonic() + 15
            while True:
                try:
                    await js.publish(subject, b"{}", headers={"Nats-Expected-Last-Subject-Sequence": UNUSED_SEQ})
                except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                    # the stream has no leader this instant (an election on a loaded machine): no
                    # answer about permissions either way, so ask again
                    assert time.monotonic() < settle, (user, subject, "the stream never had a leader")
                    await asyncio.sleep(0.2)
                    continue
                except nats.errors.TimeoutError:
                    return False
                except nats.js.errors.APIError as exc:
                    assert exc.err_code in (10071, 10164), (user, subject, exc)
                    return True
                raise AssertionError(f"{user} stored a body on {subject} despite the expected sequence")

        out = dict(zip(subject_list, await asyncio.gather(*(probe(s) for s in subject_list)), strict=True))
        await nc.flush()
        deadline = time.monotonic() + 3
        refused = [s for s, ok in out.items() if not ok]
        while refused and time.monotonic() < deadline:  # the server names every refused subject
            if all(any(f'"{s}"' in e for e in errors) for s in refused):
                break
            await asyncio.sleep(0.05)
        for s in refused:
            assert any("permissions violation" in e.lower() and f'"{s}"' in e for e in errors), (user, s, errors)
        return out
    finally:
        await nc.close()


# ------------------------------------------------------------------- 1. every role, every kind, every type


async def test_every_role_may_write_exactly_what_the_table_says_and_the_rest_is_never_applied(cluster):
    fleet, own, other = (
        "hearth",
        "a6000-east",
        "a6000-west",
    )  # the shipped users cover this fleet; nobody else uses it here
    everything = fleet_subjects(fleet, (own, other))
    users = {r: (f"agent.{fleet}.{own}" if r == "agent" else r) for r in ROLES}
    allowed: dict[str, list[str]] = {}
    probed = await asyncio.gather(*(may_publish(cluster, user, everything) for user in users.values()))
    for (role, _user), got in zip(users.items(), probed, strict=True):
        want = {s: role_writes(role, subjects.where(s).kind, subjects.where(s).domain, own) for s in everything}
        assert got == want, {s: (got[s], want[s]) for s in everything if got[s] != want[s]}
        allowed[role] = [s for s in everything if got[s]]
    assert allowed["sink"] == allowed["router"] == []
    assert allowed["projector"] == [subjects.checkpoint(fleet)]  # its checkpoints, nothing else

    # What the servers let through, every event type on it, appended as that role (chains intact).
    expected_misplaced: set[int] = set()
    placed = 0
    for role in ("agent", "promoter", "projector", "gateway", "control", "operator"):
        async with cluster.log(users[role], f"{role}:authority-test") as log:
            for subject in allowed[role]:
                w = subjects.where(subject)
                for cls in EVENT_TYPES:
                    event = build(
                        cls,
                        fleet=fleet,
                        domain=w.domain or own,
                        model="m1",
                        index=0,
                        slot="lora",
                        by=f"{role}:authority-test",
                    )
                    seq = await log.append(subject, event, expect=await log.last_seq_of(subject))
                    if authority.ALLOWED[cls] == w.kind:
                        placed += 1
                    else:
                        expected_misplaced.add(seq)
                # and a body naming another domain than its subject, where the type belongs here
                if w.domain:
                    for cls in next(p for p in authority.PLACES if p.kind == w.kind).events:
                        event = build(cls, fleet=fleet, domain=other if w.domain == own else own, model="m1")
                        expected_misplaced.add(await log.append(subject, event, expect=await log.last_seq_of(subject)))

    async with cluster.log("admin") as admin:
        records = await admin.history(subjects.fleet_events(fleet))
    verifier = Verifier()
    for rec in records:
        verifier.add(rec)
    assert verifier.breaks == []
    assert {m.seq for m in verifier.misplaced} == expected_misplaced and placed > 0
    assert all(m.by.split(":")[0] in ROLES or m.by == "" for m in verifier.misplaced)
    # Not applied: folding everything equals folding only what is placed, but for position and counts.
    everything_view = fold((r.seq, r.subject, r.event) for r in records)[fleet]
    placed_view = fold((r.seq, r.subject, r.event) for r in records if r.seq not in expected_misplaced)[fleet]
    assert same_except_position(everything_view, placed_view)
    assert everything_view.anomalies == placed_view.anomalies + len(expected_misplaced)


# ---------------------------------------------------------------- 2. an agent forges, routing holds


def forgeries(fleet: str, me: str, victim: str) -> list[tuple[str, object]]:
    """Every event type, naming the victim domain where a body names one, on each subject `me` may write."""
    mine = [
        subjects.agent(fleet, me),
        subjects.model(fleet, me, "m1"),
        subjects.gpu(fleet, me, 0),
        subjects.training(fleet, me, "lora"),
    ]
    out = []
    for subject in mine:
        for cls in EVENT_TYPES:
            out.append(
                (
                    subject,
                    build(
                        cls,
                        fleet=fleet,
                        domain=victim,
                        model="m1",
                        index=0,
                        slot="lora",
                        by=f"agent:{fleet}/{me}@forger",
                    ),
                )
            )
    return out


async def intent_active(log, fleet: str) -> tuple[str, int]:
    got = await log.last_intent(fleet)
    if got is None:
        return "", 0
    ri = intent_decoder.decode(got[0])
    return (ri.active.domain if ri.active else ""), ri.revision


@pytest.mark.timeout(150)
async def test_an_agent_forging_every_event_type_never_moves_routing(cluster, tmp_path):
    fleet = "default"
    url = {u: cluster.urls(u)[0] for u in ("agent.default.a", "agent.default.b", "promoter", "projector", "operator")}
    async with cluster.log("operator", "cli:test") as operator, cluster.log("admin") as admin:
        await apply(operator, layout(heartbeat_timeout_ms=3000, degraded_grace_ms=1000), now(), by="cli:test")
        async with (
            FakeAgent(url["agent.default.a"], fleet, "a", ["m1", "m2"]) as a,
            FakeAgent(url["agent.default.b"], fleet, "b", ["m1", "m2"]),
            cluster.log("projector", "projector:test") as projector_log,
        ):
            projector = asyncio.create_task(Projector(projector_log).run())
            try:
                async with promoters(url["promoter"]):
                    first = await wait_view(
                        admin,
                        lambda v: (
                            v.active == "a"
                            and v.operation is None
                            and v.last_operation is not None
                            and v.last_operation.state == "completed"
                            and all(isinstance(m.residency, Sleeping) for m in v.domains["b"].models.values())
                        ),
                        timeout=60,
                        what="first route to a, b asleep",
                    )
                    await wait_until(lambda: _intent_is(projector_log, fleet, "a"), 20, what="the intent on a")
                    ops_before = len(await op_events(admin, fleet))

                    # Agent a forges, with its own credentials, on every subject it may write.
                    forged: list[int] = []
                    for subject, event in forgeries(fleet, "a", "b"):
                        forged.append(await a.log.append(subject, event, expect=await a.log.last_seq_of(subject)))
                    await wait_view(admin, lambda v: v.seq >= forged[-1], what="the forgeries folded")
                    await asyncio.sleep(1.0)  # rounds of the promoter and projector on what they folded

                    view = await view_of(admin, fleet)
                    assert view.active == "a" and view.route_revision == first.route_revision
                    assert view.domains == (await view_of_placed(admin, fleet)).domains
                    assert [m.active for m in await route_moves(admin, fleet)] == ["a"]
                    assert await intent_active(projector_log, fleet) == ("a", first.route_revision)
                    assert not [
                        e for e in (await op_events(admin, fleet))[ops_before:] if isinstance(e, PromotionRequested)
                    ]

                    # The next genuine promotion probes b and flips the route.
                    accepted = await request_operation(operator, fleet, "promotion", "b", by="cli:test", now=now())
                    assert accepted.status == "accepted", accepted
                    end = await wait_op_end(admin, accepted.op_id, timeout=40, fleet=fleet)
                    assert isinstance(end, OperationCompleted), [
                        str(e) for e in await op_events(admin, fleet, accepted.op_id)
                    ]
                    await wait_until(lambda: _intent_is(projector_log, fleet, "b"), 20, what="the intent on b")
            finally:
                await cancel_and_wait(projector)
        moves = [r for r in await admin.history(subjects.route(fleet)) if isinstance(r.event, RouteMoved)]
        assert [r.event.active for r in moves] == ["a", "b"]
        records = await admin.history(subjects.fleet_events(fleet))
        for move in moves:  # the pointer only ever moved to a domain probed in the operation that moved it
            before = [
                r.event for r in records if r.seq < move.seq and getattr(r.event, "op_id", None) == move.event.op_id
            ]
            assert any(isinstance(e, StepCompleted) and e.step == "probe" for e in before), move
        assert {m.seq for m in misplaced_records(records)} == set(forged)

    # `haru verify` as the operator: the chains are intact, and every forgery is named, with exit 8.
    env = {k: v for k, v in os.environ.items() if k not in ("HARU_API_TOKEN",)}
    env["HARU_NATS_URL"] = ",".join(cluster.urls("operator"))
    done = await asyncio.to_thread(haru_cli, ["verify", "--json"], env)
    assert done.returncode == 8, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["breaks"] == []
    named = {m["seq"] for m in report["misplaced"] if m["subject"].startswith(f"haru.evt.{fleet}.")}
    assert set(forged) <= named
    assert all(m["by"] == "agent:default/a@forger" for m in report["misplaced"] if m["seq"] in forged)


async def _intent_is(log, fleet: str, active: str) -> bool:
    return (await intent_active(log, fleet))[0] == active


async def view_of_placed(log, fleet: str):
    records = [
        r
        for r in await log.history(subjects.fleet_events(fleet))
        if r.event is not None and not authority.misplaced(r.subject, r.event)
    ]
    return fold((r.seq, r.subject, r.event) for r in records)[fleet]


# ------------------------------------------- 3. an agent publishes adapters and carries checkpoints, no more


async def test_an_agent_adds_adapter_objects_and_replaces_its_checkpoints_but_purges_nothing_else(cluster):
    from nats.js import api

    from haru.log.training_objects import JsObjects, digest_of

    errors: list[str] = []
    nc = await cluster.raw("agent.hearth.a6000-east", errors)
    try:
        js = nc.jetstream(timeout=2.0)
        objects = JsObjects(js, subjects.ADAPTERS_BUCKET)  # made by ensure_streams.py, R3 like the streams
        stored = await objects.put("hearth/m1:twice/run-1", b"adapter bytes")
        assert stored.digest == digest_of(b"adapter bytes")
        assert await objects.info("hearth/m1:twice/run-1") == stored
        got = await objects.get("hearth/m1:twice/run-1")
        assert got is not None and got[1] == b"adapter bytes"
        # what it may not do: make a bucket, purge one (so replace or delete an object)
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
            await js.create_object_store("mine", config=api.ObjectStoreConfig(bucket="mine"))
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
            await js.purge_stream(f"OBJ_{subjects.ADAPTERS_BUCKET}")
        # its slots' checkpoints: replaced at each upload (the old chunks purged), deleted when the run is published
        checkpoints = JsObjects(js, subjects.CHECKPOINTS_BUCKET)
        await checkpoints.put("hearth/lora", b"step 10", note="step-10")
        second = await checkpoints.put("hearth/lora", b"step 20", note="step-20")
        assert await checkpoints.info("hearth/lora") == second
        await checkpoints.delete("hearth/lora")
        assert await checkpoints.info("hearth/lora") is None
    finally:
        await nc.close()
    async with cluster.log("admin") as admin:
        info = await admin.js.stream_info(f"OBJ_{subjects.CHECKPOINTS_BUCKET}")
        assert info.config.num_replicas == 3 and info.state.messages == 1  # the delete marker, no chunk left
        info = await admin.js.stream_info(f"OBJ_{subjects.ADAPTERS_BUCKET}")
        assert info.config.num_replicas == 3 and info.state.messages == 2  # one chunk, one meta: nothing purged
