"""The `haru` command line.

Each module in this package that defines `register(subparsers)` adds its own subcommands; the
dispatcher finds them, so areas of the code base do not edit one shared file. A subcommand's
handler is `async def run(args) -> ExitStatus` (or a plain function returning one).

Results go to stdout, diagnostics to stderr; a failure is explained in one line with the fix.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import pkgutil
import sys

from haru.cli.common import ExitStatus, fail
from haru.core.errors import AgentGone, Conflict, HaruError, LogDamaged, LogUnavailable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="haru",
        description="Haru: residency truth and hot failover for self-hosted LLM inference fleets.",
    )
    parser.add_argument("--version", action="version", version=f"haru {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("haru")
    except PackageNotFoundError:
        return "0.1.0 (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    fleet = getattr(args, "fleet", None)
    if isinstance(fleet, str) and hasattr(args, "nats_url"):
        from haru.core.specs import as_uuid

        if as_uuid(fleet):  # Haru's API took "slug or UUID": so does every --fleet
            from haru.cli.common import fleet_by_uuid

            try:
                name = _run_async(fleet_by_uuid(args.nats_url, getattr(args, "nats_creds", None), fleet))
            except LogUnavailable as exc:
                return int(fail(str(exc), ExitStatus.UNAVAILABLE))
            if not name:
                return int(
                    fail(
                        f"no fleet has UUID {fleet} (GET /v1/fleets on the gateway lists each fleet's UUID)",
                        ExitStatus.NOT_FOUND,
                    )
                )
            args.fleet = name
    try:
        if inspect.iscoroutinefunction(handler):
            status = _run_async(handler(args))
        else:
            status = handler(args)
    except KeyboardInterrupt:
        return int(ExitStatus.INTERRUPTED)
    except BrokenPipeError:
        # stdout went away (`haru history | head`): not an error worth a traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitStatus.OK)
    except (LogUnavailable, AgentGone) as exc:
        return int(fail(str(exc), ExitStatus.UNAVAILABLE))
    except LogDamaged as exc:
        return int(fail(str(exc), ExitStatus.LOG_DAMAGED))
    except Conflict as exc:
        return int(fail(str(exc), ExitStatus.CONFLICT))
    except HaruError as exc:
        return int(fail(str(exc)))
    return int(status if status is not None else ExitStatus.OK)


def _run_async(coro):
    if os.environ.get("HARU_NO_UVLOOP") != "1":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            # outside the try: an ImportError raised by the command itself is the command's error, not
            # a reason to run the (already started) coroutine a second time
            return uvloop.run(coro)
    return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
