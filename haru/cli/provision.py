"""`haru provision <domain>`, `haru teardown <domain>`, `haru replace <domain>`: provisioning operations.

    haru provision <domain> [--fleet F] [--wait] [--json] [--dry-run [--layout FILE]]
    haru teardown  <domain> [--fleet F] [--wait] [--json] [--dry-run [--layout FILE]]
    haru replace   <domain> [--fleet F] [--wait] [--json] [--dry-run [--layout FILE]]

Each requests an operation the promoter drives (`haru op` shows its steps): provision launches the
domain's SkyPilot cluster or SkyServe service, waits for its agent and models, and makes it the
standby; teardown takes down every cluster or service of the domain; replace does both, old host
first. Only `provider: skypilot | skyserve` domains are provisioned: a static host is the operator's.

`--dry-run` submits nothing and needs no promoter: it prints the YAML the operation would submit to
`sky launch` (a task) or `sky serve up` (a service), and for teardown the `sky` commands. The
declaration is read from `--layout FILE` when given, else from the fleet's declarations in the log.
Secrets appear by name only. Exit statuses as `haru promote`: 0 accepted/joined/noop, 4 conflict,
1 refused, 3 no such fleet or domain.
"""

from __future__ import annotations

import argparse

from haru.cli.common import ExitStatus, add_fleet_option, add_nats_options, fail

VERBS = {
    "provision": (
        "provision",
        "launch a skypilot/skyserve domain's host, wait for its agent and models, make it the standby",
    ),
    "teardown": ("teardown", "tear down every cluster (or service) of a skypilot/skyserve domain"),
    "replace": ("replace", "replace a domain's host: tear down the old, launch a new one, make it the standby"),
}


def register(subparsers) -> None:
    for verb, (kind, help_text) in VERBS.items():
        q = subparsers.add_parser(verb, help=help_text, description=help_text + " (docs/provisioning.md)")
        q.add_argument("domain", help="the domain")
        add_fleet_option(q)
        q.add_argument(
            "--dry-run",
            action="store_true",
            help="print the YAML (or sky commands) it would submit, and submit nothing",
        )
        q.add_argument(
            "--layout",
            default="",
            help="with --dry-run: read the domain from this layout file instead of the fleet's declarations in the log",
        )
        q.add_argument("--wait", action="store_true", help="follow the operation and print each step, then the outcome")
        q.add_argument("--timeout", type=float, default=3600.0, help="with --wait: give up after this many seconds")
        q.add_argument("--json", action="store_true", help="print JSON")
        add_nats_options(q)
        q.set_defaults(handler=run, kind=kind)


async def run(args: argparse.Namespace) -> ExitStatus:
    if not args.dry_run:
        if args.layout:
            return fail(
                "--layout is for --dry-run: an operation acts on the fleet's declarations "
                "(`haru apply` the layout first)",
                ExitStatus.USAGE,
            )
        from haru.cli.promote import run_request

        return await run_request(args)
    return await dry_run(args)


async def dry_run(args: argparse.Namespace) -> ExitStatus:
    from haru.core.errors import LayoutError, LogUnavailable
    from haru.provision import NotProvisionable, dry_run_text

    if args.layout:
        from haru.core.layout import load_layout

        try:
            layout = load_layout(args.layout)
        except LayoutError as exc:
            return fail(str(exc))
        fleet = layout.fleet
        found = layout.domain(args.domain)
        spec = found.spec if found is not None else None
        known = [d.spec.name for d in layout.domains]
    else:
        try:
            fleet, spec, known = await _declared(args)
        except LogUnavailable as exc:
            return fail(str(exc), ExitStatus.UNAVAILABLE)
    if spec is None:
        return fail(
            f"no domain {args.domain!r} in fleet {fleet} (declared: {', '.join(known) or 'none'})", ExitStatus.NOT_FOUND
        )
    try:
        text = dry_run_text(args.kind, fleet, spec)
    except NotProvisionable as exc:
        return fail(str(exc))
    if args.json:
        from haru.cli.common import emit_json

        emit_json({"kind": args.kind, "fleet": fleet, "domain": spec.name, "provider": spec.provider, "submit": text})
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return ExitStatus.OK


async def _declared(args: argparse.Namespace):
    from haru.cli.promote import _servers
    from haru.core import subjects
    from haru.core.apply import fold_declarations
    from haru.core.authority import misplaced
    from haru.log.eventlog import EventLog

    async with EventLog.connect(_servers(args), writer="cli:dry-run", creds=args.nats_creds) as log:
        records = await log.history(subjects.decl(args.fleet))
    declared = fold_declarations(r.event for r in records if r.event is not None and not misplaced(r.subject, r.event))
    return args.fleet, declared.domains.get(args.domain), list(declared.domains)
