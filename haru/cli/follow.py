"""`haru route follow TARGET ...`: keep a router's upstreams on the fleet's route (haru.routers).

    haru route follow haproxy --socket /run/haproxy/admin.sock [--backend haru_default] [--slots haru1,haru2]
    haru route follow nginx --file /etc/nginx/haru/default.conf [--upstream haru_default] [--reload 'nginx -s reload']
                            [--pid-file /run/nginx.pid]
    haru route follow envoy --file /etc/envoy/haru_default.eds.yaml [--cluster haru_default]
    haru route follow --exec 'my-router-update'         # the intent as JSON on its stdin

Each runs until stopped, under the NATS user given (`--nats-creds`, or the URL's user: the `router.<fleet>.<name>`
user of deploy/nats may read the route and report only as itself), reporting on haru.router.<fleet>.<name>.
Exit statuses: usage 2 (a missing or bad option: the message names it), unavailable 6 (NATS cannot be reached
at start), error 1 (the route stream went away).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import socket
import sys
from pathlib import Path

from haru.cli.common import ExitStatus, fail, nats_servers

TARGETS = ("haproxy", "nginx", "envoy")


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("route follow (haru route follow haproxy|nginx|envoy, or --exec CMD)")
    g.add_argument("--name", default="", help="this router's name in reports (default: <target>-<host name>)")
    g.add_argument("--socket", default="", help="haproxy: the runtime API socket (a path, or host:port)")
    g.add_argument("--backend", default="", help="haproxy: the backend the follower owns (default haru_<fleet>)")
    g.add_argument(
        "--slots", default="haru1,haru2,haru3,haru4", help="haproxy: its server slots (server-template haru 4 ...)"
    )
    g.add_argument("--file", default="", help="nginx: the upstream include file; envoy: the EDS file")
    g.add_argument("--upstream", default="", help="nginx: the upstream's name (default haru_<fleet>)")
    g.add_argument("--reload", default="nginx -s reload", help="nginx: the reload command")
    g.add_argument("--pid-file", default="", help="nginx: its pid file, to check the reload started new workers")
    g.add_argument("--cluster", default="", help="envoy: the cluster's name (default haru_<fleet>)")
    g.add_argument("--exec", dest="exec_cmd", default="", metavar="CMD", help="run CMD with the intent on stdin")
    g.add_argument("--exec-timeout", type=float, default=30.0, help="--exec: kill CMD after this many seconds")
    g.add_argument("--interval", type=float, default=1.0, help="seconds between reports (the liveness)")
    g.add_argument("--resync", type=float, default=30.0, help="seconds between re-applying the current route")


def _default_name(kind: str) -> str:
    host = re.sub(r"[^a-z0-9_-]", "-", socket.gethostname().lower())[:40].strip("-") or "host"
    return f"{kind}-{host}"


def build_target(args: argparse.Namespace, words: list[str]):  # -> RouterTarget | str (the usage error)
    from haru.routers import Command, Envoy, HAProxy, Nginx

    kind = words[0] if words else ""
    if args.exec_cmd:
        if kind:
            return f"--exec takes no target, got {kind!r}: use `haru route follow --exec CMD`"
        try:
            return Command(args.exec_cmd, timeout=args.exec_timeout)
        except ValueError as exc:
            return str(exc)
    if kind not in TARGETS or len(words) > 1:
        return f"haru route follow takes one of {', '.join(TARGETS)} or --exec CMD, got {' '.join(words) or 'nothing'}"
    default = f"haru_{args.fleet.replace('-', '_')}"
    if kind == "haproxy":
        if not args.socket:
            return "haproxy needs --socket: HAProxy's runtime API (`stats socket /run/haproxy/admin.sock level admin`)"
        slots = tuple(s for s in args.slots.split(",") if s)
        return HAProxy(args.socket, args.backend or default, slots)
    if not args.file:
        return f"{kind} needs --file: the file the follower writes (nginx: an upstream include; envoy: the EDS file)"
    if kind == "nginx":
        reload = shlex.split(args.reload)
        if not reload:
            return "--reload is empty: give the command that reloads nginx (default `nginx -s reload`)"
        return Nginx(
            Path(args.file), args.upstream or default, reload, pid_file=Path(args.pid_file) if args.pid_file else None
        )
    return Envoy(Path(args.file), args.cluster or default)


async def run_follow(args: argparse.Namespace, words: list[str]) -> ExitStatus:
    from haru.core.errors import HaruError, InvalidName, LogUnavailable
    from haru.core.subjects import check_name
    from haru.log.eventlog import EventLog
    from haru.routers import Follower

    target = build_target(args, words)
    if isinstance(target, str):
        return fail(target, ExitStatus.USAGE)
    name = args.name or _default_name(target.kind)
    try:
        check_name("fleet", args.fleet)
        check_name("router", name)
    except InvalidName as exc:
        return fail(str(exc), ExitStatus.USAGE)
    print(f"following fleet {args.fleet}'s route as router {name}: {target.describe()}", file=sys.stderr)
    try:
        async with EventLog.connect(nats_servers(args.nats_url), writer=f"router:{name}", creds=args.nats_creds) as log:
            follower = Follower(log, args.fleet, name, target, interval_s=args.interval, resync_s=args.resync)
            await follower.run()
    except LogUnavailable as exc:
        return fail(str(exc), ExitStatus.UNAVAILABLE)
    except HaruError as exc:
        return fail(str(exc))
    except asyncio.CancelledError:
        return ExitStatus.INTERRUPTED
    return ExitStatus.OK
