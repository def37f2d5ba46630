"""What every subcommand shares: exit statuses, output helpers, connection options."""

from __future__ import annotations

import argparse
import enum
import os
import sys

import msgspec


class ExitStatus(enum.IntEnum):
    OK = 0
    ERROR = 1  # the command failed; stderr says why
    USAGE = 2  # bad arguments (argparse's own code)
    NOT_FOUND = 3  # no such fleet, model, domain or operation
    CONFLICT = 4  # another operation is in flight, or a race was lost
    VERIFY_FAILED = 5  # history does not verify
    UNAVAILABLE = 6  # NATS or an agent cannot be reached
    INTERRUPTED = 130


def fail(message: str, status: ExitStatus = ExitStatus.ERROR) -> ExitStatus:
    """Print a one-line diagnostic to stderr and return the status."""
    print(f"haru: {message}", file=sys.stderr)
    return status


def emit_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def add_nats_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("HARU_NATS_URL", DEFAULT_NATS_URL),
        help="NATS server URL(s), comma-separated (env HARU_NATS_URL; default %(default)s)",
    )
    parser.add_argument(
        "--nats-creds",
        default=os.environ.get("HARU_NATS_CREDS"),
        help="NATS credentials file (env HARU_NATS_CREDS)",
    )


def add_fleet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fleet",
        default=os.environ.get("HARU_DEFAULT_FLEET", "default"),
        help="fleet name (env HARU_DEFAULT_FLEET; default %(default)s)",
    )


def nats_servers(url: str) -> list[str]:
    """nats-py wants a list, not a comma-separated string."""
    return [u.strip() for u in url.split(",") if u.strip()]
