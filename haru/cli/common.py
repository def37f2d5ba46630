"""What every subcommand shares: exit statuses, output helpers, connection options."""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec


class ExitStatus(enum.IntEnum):
    OK = 0
    ERROR = 1  # the command failed; stderr says why
    USAGE = 2  # bad arguments (argparse's own code)
    NOT_FOUND = 3  # no such fleet, model, domain or operation
    CONFLICT = 4  # another operation is in flight, or a race was lost
    VERIFY_FAILED = 5  # history does not verify
    UNAVAILABLE = 6  # NATS or an agent cannot be reached
    REFUSED = 7  # the planner admits none of what was asked (`haru serve`: every model is short of VRAM)
    MISPLACED = 8  # the chains are intact, but events stand on subjects they may not (haru.core.authority)
    LOG_DAMAGED = 10  # the event store cannot serve some sequences (a damaged block): stderr names them
    LOG_TRUNCATED = 11  # the event store ends before what the views folded, or was cut and written on
    INTERRUPTED = 130


def fail(message: str, status: ExitStatus = ExitStatus.ERROR) -> ExitStatus:
    """Print a one-line diagnostic to stderr and return the status."""
    print(f"haru: {message}", file=sys.stderr)
    return status


def env_count(env: str) -> Callable[[str], int]:
    """An argparse `type` for a count of one or more whose default comes from `$env`: give it the
    environment's string as the default (argparse converts a string default only when that command
    runs), so a bad value is one clear line for that command, naming the variable, and never breaks
    `haru --version` or any other command."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            hint = f" (from ${env})" if os.environ.get(env, "").strip() == text.strip() else ""
            raise argparse.ArgumentTypeError(
                f"{text!r}{hint} is not a whole number of 1 or more: set {env} or the option to one, e.g. 3"
            )
        return value

    count.__name__ = "count"
    return count


def env_default(env: str, fallback: str | None = None) -> str | None:
    """`$env` if set and not blank, else `fallback`: a string default for an `env_count` option."""
    value = os.environ.get(env, "").strip()
    return value or fallback


def emit_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def default_nats_url() -> str:
    """$HARU_NATS_URL, else the URL a running `haru up` wrote to $HARU_HOME/nats.url, else 127.0.0.1:4222."""
    explicit = os.environ.get("HARU_NATS_URL")
    if explicit:
        return explicit
    home = os.path.expanduser(os.environ.get("HARU_HOME") or "~/.haru")
    try:
        with open(os.path.join(home, "nats.url")) as f:
            url = f.read().strip()
        if url:
            return url
    except OSError:
        pass
    return DEFAULT_NATS_URL


def add_log_options(parser: argparse.ArgumentParser, *, default_level: str = "info") -> None:
    """--log-format and --log-level, for the commands that run a service."""
    parser.add_argument(
        "--log-format",
        choices=("auto", "console", "json"),
        default=os.environ.get("HARU_LOG_FORMAT", "auto"),
        help="diagnostics on stderr: console, json, or auto (console on a terminal) (env HARU_LOG_FORMAT)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("HARU_LOG_LEVEL", default_level),
        help="debug, info, warning or error (env HARU_LOG_LEVEL; default %(default)s)",
    )


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """structlog for the services: JSON in production, readable in a terminal; always to stderr."""
    import logging

    import structlog

    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def add_nats_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=default_nats_url(),
        help="NATS server URL(s), comma-separated "
        "(env HARU_NATS_URL, else the one `haru up` runs; default %(default)s)",
    )
    parser.add_argument(
        "--nats-creds",
        default=os.environ.get("HARU_NATS_CREDS"),
        help="NATS credentials file (env HARU_NATS_CREDS)",
    )


def add_replay_timeout_option(parser: argparse.ArgumentParser) -> None:
    """--timeout: how long a command may take to read the log back (its replay's deadline)."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("HARU_REPLAY_TIMEOUT", "120")),
        help="seconds to read the log back before giving up (env HARU_REPLAY_TIMEOUT; default %(default)g)",
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


class LinkReporter:
    """Says on stderr when the control plane went away and when it came back, so a watch never
    shows the last state as if it were live: `haru: control plane unreachable since <t> (<url>):
    what is shown may be stale`, then `haru: control plane reachable again at <t> (away <s> s)`."""

    def __init__(self, url: str, what: str) -> None:
        self.url = url
        self.what = what
        self.since: datetime | None = None

    def __call__(self, up: bool) -> None:
        now = datetime.now(UTC)
        if not up and self.since is None:
            self.since = now
            print(
                f"haru: control plane unreachable since {now:%Y-%m-%dT%H:%M:%SZ} ({self.url}): "
                f"{self.what} may be stale; retrying",
                file=sys.stderr,
                flush=True,
            )
        elif up and self.since is not None:
            away = (now - self.since).total_seconds()
            self.since = None
            print(
                f"haru: control plane reachable again at {now:%Y-%m-%dT%H:%M:%SZ} (away {away:.1f} s)",
                file=sys.stderr,
                flush=True,
            )


async def fleet_by_uuid(nats_url: str, creds: str | None, wanted: str) -> str:
    """The name of the fleet whose UUID is `wanted` (its view's, declared or derived from its name), ''
    when no stored view has it. Raises LogUnavailable when NATS cannot be reached."""
    from haru.core.specs import as_uuid, fleet_uuid
    from haru.core.views import view_decoder
    from haru.log.eventlog import EventLog

    wanted = as_uuid(wanted)
    async with EventLog.connect(nats_servers(nats_url), writer="cli:fleet-uuid", creds=creds) as log:
        for raw in (await log.views()).values():
            try:
                view = view_decoder.decode(raw)
            except msgspec.DecodeError:
                continue
            if (view.uuid or fleet_uuid(view.fleet)) == wanted:
                return view.fleet
    return ""


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The --model options `haru serve` and `haru up --model` share (a one-domain fleet from flags)."""
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=[gguf:|safetensors:]PATH_OR_REF:GiB[@CTX]",
        help="a model to serve (repeat it): its id, a path or a reference (qwen3:0.6b, "
        "hf:ORG/REPO[:QUANT]) pulled first, the VRAM to book and the context length",
    )
    # hearth's spelling of one model: `--model NAME --gguf PATH` (or --safetensors DIR), --binary, --vram.
    p.add_argument("--gguf", default="", metavar="PATH", help="hearth's spelling: --model NAME --gguf PATH")
    p.add_argument("--safetensors", default="", metavar="DIR", help="hearth's spelling: --model NAME --safetensors DIR")
    p.add_argument(
        "--vram",
        default="",
        metavar="GiB",
        help="with --gguf/--safetensors: the VRAM to book (default: the weights on disk + 25%%)",
    )
    p.add_argument(
        "--binary",
        default="",
        metavar="PATH",
        help="the runtime binary when every model uses one runtime (llama-server for GGUF, vllm for "
        "safetensors) instead of the managed one; a fleet of both takes --llama-binary and --vllm-binary",
    )
    p.add_argument("--llama-binary", default="", metavar="PATH", help="the llama-server for the GGUF models")
    p.add_argument("--vllm-binary", default="", metavar="PATH", help="the vllm for the safetensors models")
    p.add_argument(
        "--fleet-conf",
        default=None,
        metavar="FILE",
        help="hearth's fleet.conf: one `model NAME=[gguf:|safetensors:]PATH:GiB[@CTX]` line per model "
        "(default $HARU_HOME/fleet.conf when no --model is given and it exists)",
    )
    p.add_argument(
        "--gpu-memory",
        default=None,
        metavar="GiB",
        help="plan against a simulated GPU of this size (runtimes on the CPU); default: NVML's GPU 0",
    )
    p.add_argument("--reserve", default="1", metavar="GiB", help="VRAM never planned into (default %(default)s GiB)")
    p.add_argument("--fleet-name", default=os.environ.get("HARU_DEFAULT_FLEET", "default"), help="fleet name")
    p.add_argument("--quant", default="", help="GGUF quantization preference for references (env HARU_GGUF_QUANTS)")
    p.add_argument(
        "--runtime-args",
        default=os.environ.get("HARU_RUNTIME_ARGS", ""),
        help='extra arguments for every runtime, one string (e.g. "--threads 4")',
    )
