#!/usr/bin/env python3
"""Write the NATS users and subject permissions of a Haru deployment (deploy/nats/accounts.conf).

    python deploy/nats/gen_users.py deploy/examples/demo-fleet.json deploy/examples/hearth.json \
        --agent edge:box-1 --router default:edge-1 -o deploy/nats/accounts.conf \
        --env-example deploy/nats/nats.env.example
    python deploy/nats/gen_users.py fleet-prod.json fleet-lab.json --agent lab:gpu-9 -o accounts.conf
    python deploy/nats/gen_users.py fleet.json --env-secrets /etc/haru/nats.env   # random passwords, mode 0600
    python deploy/nats/gen_users.py fleet.json --nsc                              # nsc commands (JWT mode)

Plain nats-server users have no permission templates (`{{name()}}` exists only in JWT/operator mode),
so an agent's permissions name its fleet and domain literally: one user per domain, generated here
from the layout files (only "fleet" and "domains[].name" are read). Every password is a reference
to an environment variable (`password: $HARU_NATS_PASSWORD_...`): nats-server resolves it when it
starts and refuses to start when one is missing, so no secret lives in this file.

The roles (docs/design.md, "Security in brief"):
  agent.<fleet>.<domain>  publishes only its own domain's events (agent, model.*, gpu.*, training.*, integrity:
                          not liveness, which the promoter writes) and heartbeat; adds objects (published
                          adapters) to the object store haru_adapters; replaces and deletes objects (its
                          slots' checkpoints) in haru_checkpoints, the one stream it may purge; answers only its own
                          commands (haru.cmd.<fleet>.<domain>.>, nats.micro's $SRV.>) and may ask its own
                          status (the duplicate-agent check); reads the event log and the views (haru_views,
                          read only: the adapters to load) through consumers and message gets; appends use
                          expected sequences.
  promoter                writes op, route, weights, integrity and liveness events of any fleet; requests haru.cmd.>;
                          reads events, views and intents; subscribes haru.hb.> and the gateways'
                          canary reports (haru.canary.>); beats on haru.alive.promoter.> and hears its
                          peers there.
  projector               reads events; writes the KV bucket haru_views, haru.route.> and checkpoints
                          (haru.evt.*.checkpoint); beats on
                          haru.alive.projector.>.
  gateway                 reads views, intents and events; writes haru.evt.*.op (promote/demote/weighting
                          requests) and haru.evt.*.usage (tokens served, docs/cost.md); reports what
                          it measured of weighted domains on haru.canary.>; hears haru.alive.> for /healthz.
  control                 projector + promoter + gateway in one process (`haru up --nats-url`).
  operator                the `haru` CLI: declarations (haru apply), op requests, commands; reads all.
  sink                    reads the event log (the Postgres read model).
  router                  may only subscribe haru.route.>, read stream HARU_ROUTE and each fleet's last
                          route_moved (a direct get of haru.evt.<fleet>.route).
  router.<fleet>.<name>   a route follower (`haru route follow`): reads its fleet's route and reports only
                          as itself on haru.router.<fleet>.<name> (--router FLEET:NAME).
  admin                   everything, including creating streams (`ensure(replicas=3)`).
Nobody but admin may use the stream/consumer DELETE, PURGE or UPDATE APIs, nor STREAM.MSG.DELETE (but an agent
may purge the checkpoints bucket).

Standard library only, so it runs on a NATS host without Haru installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import sys
from dataclasses import dataclass, field

EVENTS = "HARU_EVENTS"
ROUTE = "HARU_ROUTE"
VIEWS = "KV_haru_views"  # the stream behind the KV bucket haru_views
ADAPTERS_BUCKET = "haru_adapters"  # the object store of published LoRA adapters
CHECKPOINTS_BUCKET = "haru_checkpoints"  # the object store of training slots' newest checkpoints
NAME = re.compile(r"[a-z0-9_-]{1,64}")
RESERVED_DOMAINS = {"decl", "route", "op", "usage"}
ACCOUNT = "HARU"

# The JetStream API subjects nobody but admin may publish to (deny beats allow in nats-server: this
# list is a second fence behind the allow lists, which never name these anyway).
DESTRUCTIVE = [
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.UNPIN.>",
]


def read_stream(stream: str) -> list[str]:
    """Publish subjects a client needs to read `stream` the way nats-py does: stream info, last-by-subject
    and by-sequence gets (STREAM.MSG.GET and DIRECT.GET), ephemeral ordered push consumers
    (CONSUMER.CREATE, with or without the name/filter suffix, their info, and flow-control replies)."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def object_writes(bucket: str) -> list[str]:
    """Publish subjects a client needs to add objects to the object store `bucket` and read them the way
    nats-py does: the bucket's stream (info, an object's meta by direct get, its chunks through an ordered
    consumer, which first looks the stream up by subject: STREAM.NAMES), then the chunks and the meta."""
    return [*read_stream(f"OBJ_{bucket}"), "$JS.API.STREAM.NAMES", f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"]


@dataclass(frozen=True)
class User:
    name: str
    comment: str
    publish: list[str]
    subscribe: list[str]
    deny_publish: list[str] = field(default_factory=lambda: list(DESTRUCTIVE))
    allow_responses: bool = False

    @property
    def env(self) -> str:
        return "HARU_NATS_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", self.name.upper())


INBOX = "_INBOX.>"  # replies to this client's own requests and JetStream acks / deliveries


def fixed_users() -> list[User]:
    events, route, views = read_stream(EVENTS), read_stream(ROUTE), read_stream(VIEWS)
    # `EventLog.ensure`, which these roles' commands run at start, checks that the adapters bucket exists (only
    # admin may create it): its stream's info, nothing more.
    views = [*views, f"$JS.API.STREAM.INFO.OBJ_{ADAPTERS_BUCKET}", f"$JS.API.STREAM.INFO.OBJ_{CHECKPOINTS_BUCKET}"]
    promoter_pub = [
        "haru.evt.*.op",
        "haru.evt.*.route",
        "haru.evt.*.weights",
        "haru.evt.*.*.liveness",
        "haru.evt.*.integrity",  # log_regressed: the log lost what the promoter was acknowledged
        "haru.cmd.>",
        "$SRV.>",
        *events,
        *views,
        *route,
    ]
    # haru.alive.<role>.<id>: the control plane's own heartbeats (haru/host/alive.py), read by gateways and promoters
    promoter_pub.append("haru.alive.promoter.>")
    # `haru promoter --stream-leaders`: a step-down naming the preferred server (haru/log/leaders.py)
    promoter_pub += [f"$JS.API.STREAM.LEADER.STEPDOWN.{s}" for s in (EVENTS, ROUTE, VIEWS)]
    projector_pub = [
        "haru.evt.*.checkpoint",
        "$KV.haru_views.>",
        "haru.route.>",
        "haru.alive.projector.>",
        *events,
        *views,
        *route,
    ]
    gateway_pub = ["haru.evt.*.op", "haru.evt.*.usage", "haru.canary.>", *events, *views, *route]
    return [
        User(
            "admin",
            "everything: stream creation (ensure), repairs, `nats` CLI administration",
            publish=[">"],
            subscribe=[">"],
            deny_publish=[],
        ),
        User(
            "promoter",
            "the failover saga: op/route/liveness events, agent commands, heartbeats",
            publish=promoter_pub,
            subscribe=["haru.hb.>", "haru.canary.>", "haru.alive.promoter.>", "haru.router.>", INBOX],
        ),
        User(
            "projector",
            "folds events into the KV views and route intents",
            publish=projector_pub,
            subscribe=["haru.hb.>", INBOX],
        ),
        User(
            "gateway",
            "reads views, intents and history; requests promotions/demotions (op events)",
            publish=gateway_pub,
            subscribe=["haru.hb.>", "haru.route.>", "haru.alive.>", "haru.router.>", INBOX],
        ),
        User(
            "control",
            "projector + promoter + gateway in one process (`haru up --nats-url`)",
            publish=_union(promoter_pub, projector_pub, gateway_pub),
            subscribe=["haru.hb.>", "haru.canary.>", "haru.route.>", "haru.alive.>", "haru.router.>", INBOX],
        ),
        User(
            "operator",
            "the haru CLI: apply (decl), promote/demote (op), agent commands, reads",
            publish=[
                "haru.evt.*.decl",
                "haru.evt.*.op",
                "haru.cmd.>",
                "$SRV.>",
                "haru.routers.ask.>",
                *events,
                *views,
                *route,
            ],
            subscribe=["haru.hb.>", "haru.route.>", "haru.alive.>", "haru.router.>", INBOX],
        ),
        User(
            "sink",
            "`haru sink postgres`: reads the event log, writes nothing to NATS",
            publish=list(events),
            subscribe=[INBOX],
        ),
        User(
            "router",
            "may only subscribe haru.route.>, read stream HARU_ROUTE and each fleet's last route_moved",
            publish=[*read_stream(ROUTE), route_tip("*")],
            subscribe=["haru.route.>", INBOX],
        ),
    ]


def agent_user(fleet: str, domain: str) -> User:
    own = f"haru.evt.{fleet}.{domain}"
    return User(
        f"agent.{fleet}.{domain}",
        f"the agent of fleet {fleet!r} domain {domain!r}: its own events, heartbeat and commands only",
        publish=_union(
            [
                f"{own}.agent",
                f"{own}.model.*",
                f"{own}.gpu.*",
                f"{own}.training.*",
                f"{own}.integrity",  # domain_log_regressed: the log lost what this agent was acknowledged
                f"haru.hb.{fleet}.{domain}",
                # At start an agent asks its own status command (and listens to its own heartbeat subject)
                # to refuse to run beside a second agent of the same domain.
                f"haru.cmd.{fleet}.{domain}.status",
                *read_stream(EVENTS),
                # The fleet views (KV bucket haru_views), read only: the adapter watcher (agents/adapters.py) watches
                # its fleet's view for the adapter versions to load. A KV watch is an ordered consumer on the
                # bucket's stream (CONSUMER.CREATE with the key in the body, its info, flow control) and a get a
                # DIRECT.GET: no $KV.haru_views.> publish, so no put, delete or purge of a key. The views are folded
                # from the event log it reads already, so this tells it nothing new.
                *read_stream(VIEWS),
                # A finished training run's adapter: a new object (its chunks, then its meta) in the adapters bucket,
                # after reading whether that version is already there. No purge, so no object is ever replaced.
                *object_writes(ADAPTERS_BUCKET),
                # Its training slots' newest checkpoint, replaced at each upload (nats-py purges the old object's
                # chunks) and deleted once the run is published: the one bucket it may purge.
                *object_writes(CHECKPOINTS_BUCKET),
                f"$JS.API.STREAM.PURGE.OBJ_{CHECKPOINTS_BUCKET}",
            ]
        ),
        deny_publish=[d for d in DESTRUCTIVE if d != "$JS.API.STREAM.PURGE.>"]
        + [f"$JS.API.STREAM.PURGE.{s}" for s in (EVENTS, ROUTE, VIEWS, f"OBJ_{ADAPTERS_BUCKET}")],
        subscribe=[f"haru.cmd.{fleet}.{domain}.>", f"haru.hb.{fleet}.{domain}", "$SRV.>", INBOX],
        allow_responses=True,
    )


def route_tip(fleet: str) -> str:
    """A direct get of the fleet's last route_moved, the one event a route follower reads: after a lost link it
    checks an intent names the log's newest route move (haru/log/route.py). The request's subject names the
    subject read, so the permission reaches no other event."""
    return f"$JS.API.DIRECT.GET.{EVENTS}.haru.evt.{fleet}.route"


def router_user(fleet: str, name: str) -> User:
    return User(
        f"router.{fleet}.{name}",
        f"the route follower {name!r} of fleet {fleet!r}: reads the route, reports only as itself",
        publish=[f"haru.router.{fleet}.{name}", *read_stream(ROUTE), route_tip(fleet)],
        subscribe=[f"haru.route.{fleet}", f"haru.routers.ask.{fleet}", INBOX],
    )


def _union(*lists: list[str]) -> list[str]:
    out: list[str] = []
    for items in lists:
        out += [s for s in items if s not in out]
    return out


# ------------------------------------------------------------------------------------------ render


def _q(s: str) -> str:
    return json.dumps(s)


def _list(items: list[str], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {_q(s)}\n" for s in items) + f"{indent}]"


def render_user(u: User) -> str:
    ind = "        "
    lines = [f"      # {u.comment}", "      {", f"{ind}user: {_q(u.name)}", f"{ind}password: ${u.env}"]
    lines.append(f"{ind}permissions: {{")
    pub = f"{ind}  publish: {{ allow: {_list(u.publish, ind + '  ')}"
    if u.deny_publish:
        pub += f", deny: {_list(u.deny_publish, ind + '  ')}"
    lines.append(pub + " }")
    lines.append(f"{ind}  subscribe: {{ allow: {_list(u.subscribe, ind + '  ')} }}")
    if u.allow_responses:
        lines.append(f"{ind}  allow_responses: true")
    lines.append(f"{ind}}}")
    lines.append("      }")
    return "\n".join(lines)


def render(users: list[User], sources: list[str]) -> str:
    head = f"""\
# Haru NATS users and subject permissions. GENERATED by deploy/nats/gen_users.py from:
#   {", ".join(sources) or "(no layout)"}
# Regenerate after adding a fleet or a domain; do not edit by hand.
#
# EXAMPLE: every password is an environment variable reference ($HARU_NATS_PASSWORD_*), resolved by
# nats-server at start (it refuses to start when one is missing). Put them in /etc/haru/nats.env
# (mode 0600, see deploy/nats/nats.env.example) for the nats-server unit's EnvironmentFile, or
# create them with `gen_users.py --env-secrets /etc/haru/nats.env`.
# Clients log in with nats://<user>:<password>@host:4222. Switching to nkeys/JWT: deploy/README.md.

accounts {{
  {ACCOUNT} {{
    jetstream: enabled
    users: [
"""
    body = "\n".join(render_user(u) for u in users)
    tail = """
    ]
  }
  # The system account: `nats server report jetstream`, `nats server list` (--user sys).
  SYS {
    users: [
      { user: "sys", password: $HARU_NATS_PASSWORD_SYS }
    ]
  }
}
system_account: SYS
"""
    return head + body + tail


def env_lines(users: list[User], *, generate: bool) -> str:
    out = ["# Secrets of the Haru NATS cluster (the nats-server units' EnvironmentFile). Mode 0600, owner root."]
    if not generate:
        out.append("# EXAMPLE with placeholder values: replace every one (`gen_users.py --env-secrets FILE` does).")

    def secret(name: str) -> str:
        if generate:
            # nats-server parses a variable's value as a config value: a leading digit makes it a number
            # (and "true", "no"... booleans). A letter, then hex: a string, and URL-safe as it must be in
            # nats://user:password@host URLs.
            return "s" + secrets.token_hex(20)
        return "change-me-" + name.lower().removeprefix("haru_nats_password_").removeprefix("haru_nats_").replace(
            "_", "-"
        )

    for n in [u.env for u in users] + ["HARU_NATS_PASSWORD_SYS"]:
        out.append(f"{n}={secret(n)}")
    route = secret("HARU_NATS_ROUTE_PASSWORD")
    out += [
        "# Routes between the three nodes. Outgoing routes do not reuse the cluster's authorization block and a",
        "# URL cannot interpolate a variable, so each route is one variable holding its whole URL. Replace the",
        "# host names with the nodes' private addresses.",
        f"HARU_NATS_ROUTE_PASSWORD={route}",
    ]
    for i in (1, 2, 3):
        out.append(f"HARU_NATS_ROUTE_{i}=nats-route://route:{route}@nats-{i}.haru.internal:6222")
    return "\n".join(out) + "\n"


def nsc_commands(users: list[User]) -> str:
    """The same users for JWT/operator mode (nsc), where clients log in with a .creds file."""
    out = [
        "# Run after `nsc add operator haru --sys` and `nsc add account HARU` (JetStream enabled with",
        "# `nsc edit account HARU --js-disk-storage -1 --js-mem-storage -1 --js-streams -1 --js-consumer -1`).",
    ]
    for u in users:
        if u.name == "admin":
            out.append("nsc add user --account HARU --name admin")
            continue
        args = [f"--allow-pub {shlex.quote(','.join(u.publish))}", f"--allow-sub {shlex.quote(','.join(u.subscribe))}"]
        if u.deny_publish:
            args.append(f"--deny-pub {shlex.quote(','.join(u.deny_publish))}")
        if u.allow_responses:
            args.append("--allow-pub-response=1")
        out.append(f"nsc add user --account HARU --name {u.name.replace('.', '-')} " + " ".join(args))
    out.append('# then: nsc generate creds --account HARU --name <user> > <user>.creds   (agent config: "nats_creds")')
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------------- main


def domains_of(path: str) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    fleet = doc.get("fleet")
    names = [d.get("name") for d in doc.get("domains", []) if isinstance(d, dict)]
    if not isinstance(fleet, str) or not names:
        raise SystemExit(f'{path}: a layout needs "fleet" and "domains": [{{"name": ...}}, ...]')
    return [(fleet, d) for d in names]


def check(fleet: str, domain: str) -> None:
    for kind, v in (("fleet", fleet), ("domain", domain)):
        if not isinstance(v, str) or not NAME.fullmatch(v):
            raise SystemExit(f"{kind} name {v!r} is not a Haru name (lowercase [a-z0-9_-], 1..64)")
    if domain in RESERVED_DOMAINS:
        raise SystemExit(f"domain name {domain!r} is reserved")


def build(pairs: list[tuple[str, str]], routers: list[tuple[str, str]] | None = None) -> list[User]:
    users = fixed_users()
    seen: set[tuple[str, str]] = set()
    for fleet, domain in pairs:
        check(fleet, domain)
        if (fleet, domain) not in seen:
            seen.add((fleet, domain))
            users.append(agent_user(fleet, domain))
    for fleet, name in routers or []:
        for kind, v in (("fleet", fleet), ("router", name)):
            if not NAME.fullmatch(v):
                raise SystemExit(f"{kind} name {v!r} is not a Haru name (lowercase [a-z0-9_-], 1..64)")
        users.append(router_user(fleet, name))
    envs: dict[str, str] = {}
    for u in users:
        if u.env in envs:
            raise SystemExit(f"users {envs[u.env]!r} and {u.name!r} would share {u.env}; rename one domain")
        envs[u.env] = u.name
    return users


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("layouts", nargs="*", help="layout JSON files (fleet + domains)")
    p.add_argument("--agent", action="append", default=[], metavar="FLEET:DOMAIN", help="an extra agent user")
    p.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="FLEET:NAME",
        help="a route follower's user (haru route follow)",
    )
    p.add_argument("-o", "--output", help="write the accounts file here (default: stdout)")
    p.add_argument("--env-example", metavar="FILE", help="write an EnvironmentFile with placeholder passwords")
    p.add_argument("--env-secrets", metavar="FILE", help="write an EnvironmentFile with random passwords (mode 0600)")
    p.add_argument("--nsc", action="store_true", help="print nsc commands for JWT/operator mode instead")
    args = p.parse_args(argv)

    pairs: list[tuple[str, str]] = []
    for path in args.layouts:
        pairs += domains_of(path)
    for item in args.agent:
        fleet, _, domain = item.partition(":")
        pairs.append((fleet, domain))
    users = build(pairs, [tuple(r.partition(":")[::2]) for r in args.router])  # type: ignore[misc]

    if args.nsc:
        sys.stdout.write(nsc_commands(users))
        return 0
    text = render(
        users,
        [os.path.relpath(s) if os.path.isabs(s) else s for s in args.layouts]
        + [f"--agent {a}" for a in args.agent]
        + [f"--router {r}" for r in args.router],
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.env_example:
        with open(args.env_example, "w", encoding="utf-8") as f:
            f.write(env_lines(users, generate=False))
    if args.env_secrets:
        fd = os.open(args.env_secrets, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(env_lines(users, generate=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
