"""`haru resolve REF` and `haru pull REF`: from a model reference to verified files under $HARU_HOME/models.

    haru resolve qwen3:0.6b                    what would be fetched: every blob, URL, size, digest
    haru resolve hf:Qwen/Qwen3-0.6B-GGUF --json
    haru pull hf:Qwen/Qwen3-0.6B-GGUF:Q8_0     fetch, verify, materialize; prints the path to serve

Exit statuses: 0 ok, 1 a registry or download error, 2 a reference that does not parse,
3 not found (404), 6 the registry cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from haru.cli.common import ExitStatus, add_fleet_option, add_nats_options, emit_json, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("resolve", help="what a model reference names (blobs, sizes, digests, format); fetches nothing")
    p.add_argument(
        "reference", help="qwen3:0.6b, library/qwen3:0.6b, ollama:NAME[:TAG], hf:ORG/REPO[:QUANT][@REVISION]"
    )
    _common(p)
    p.set_defaults(handler=run_resolve)

    p = sub.add_parser("pull", help="fetch a model reference into the store under $HARU_HOME (resumable, verified)")
    p.add_argument("reference", help="as for `haru resolve`")
    _common(p)
    p.add_argument(
        "--home", default=None, help="state directory; the store is <home>/models (env HARU_HOME, default ~/.haru)"
    )
    p.add_argument("--no-record", action="store_true", help="do not append the fetch to the event log")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar even on a terminal")
    add_nats_options(p)
    add_fleet_option(p)
    p.set_defaults(handler=run_pull)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quant",
        default="",
        help="GGUF quantization preference, comma-separated, first found wins "
        "(env HARU_GGUF_QUANTS; default Q4_K_M,Q5_K_M,Q8_0,Q6_K,...)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def status_of(exc: Exception) -> ExitStatus:
    from haru.core.model_errors import BadReference, NotFound, RegistryError

    if isinstance(exc, BadReference):
        return ExitStatus.USAGE
    if isinstance(exc, NotFound):
        return ExitStatus.NOT_FOUND
    if isinstance(exc, RegistryError) and exc.status == 0:
        return ExitStatus.UNAVAILABLE
    return ExitStatus.ERROR


def _size(n: int) -> str:
    from haru.core.sizes import format_size

    return format_size(n)


def print_resolution(res, out=sys.stdout) -> None:
    out.write(f"{res.reference}\n")
    quant = f" {res.quant}" if res.quant else ""
    out.write(f"  from {res.origin} {res.repository} @ {res.revision}\n")
    out.write(
        f"  format {res.format}{quant} -> runtime {res.runtime}; {len(res.blobs)} file(s), {_size(res.total_bytes)}"
        f"{'; serve ' + res.entry if res.entry else ''}\n"
    )
    width = max(len(b.name) for b in res.blobs)
    for b in res.blobs:
        out.write(f"  {b.name:<{width}}  {b.role:<9} {_size(b.size):>10}  {b.digest}\n    {b.url}\n")


async def run_resolve(args: argparse.Namespace) -> ExitStatus:
    from haru.core.model_errors import ModelsError
    from haru.models import resolve as r

    settings = r.Settings.from_env(quants=args.quant)
    try:
        async with r.session(settings) as http:
            res = await r.resolve(args.reference, settings, http)
    except ModelsError as exc:
        return fail(str(exc), status_of(exc))
    if args.json:
        import msgspec

        emit_json({**msgspec.to_builtins(res), "total_bytes": res.total_bytes})
    else:
        print_resolution(res)
    return ExitStatus.OK


async def pull_reference(
    reference: str, *, home: str | None = None, quants: str = "", progress: bool | None = None, label: str = ""
):
    """Resolve and pull one reference; the PullResult. Raises ModelsError subclasses."""
    from haru.models import resolve as r
    from haru.models.pull import Progress, pull
    from haru.models.store import Store, default_root

    settings = r.Settings.from_env(quants=quants)
    store = Store(default_root(home))
    async with r.session(settings) as http:
        res = await r.resolve(reference, settings, http)
        bar = Progress(res.total_bytes, label=label or reference, enabled=progress)
        try:
            return await pull(res, store, settings, http, progress=bar)
        finally:
            bar.close()


async def run_pull(args: argparse.Namespace) -> ExitStatus:
    from haru.core.model_errors import ModelsError

    try:
        result = await pull_reference(
            args.reference, home=args.home, quants=args.quant, progress=False if args.quiet or args.json else None
        )
    except ModelsError as exc:
        return fail(str(exc), status_of(exc))
    recorded = ""
    if not args.no_record:
        recorded = await _record(args, result)
    if args.json:
        import msgspec

        emit_json(
            {
                "path": str(result.path),
                "reference": result.resolution.reference,
                "format": result.resolution.format,
                "runtime": result.resolution.runtime,
                "fetched_bytes": result.fetched_bytes,
                "reused_bytes": result.reused_bytes,
                "healed": result.healed,
                "took_ms": result.took_ms,
                "recorded": recorded,
                "resolution": msgspec.to_builtins(result.resolution),
            }
        )
    else:
        if result.healed:
            print(
                f"haru: {len(result.healed)} file(s) in the store were corrupt and were fetched again: "
                f"{', '.join(result.healed)}",
                file=sys.stderr,
            )
        print(str(result.path))
    return ExitStatus.OK


async def _record(args: argparse.Namespace, result) -> str:
    """The fetch as a `model_fetched` event on the fleet's decl subject, when a log is reachable.
    Without one the pull still stands; stderr says it was not recorded."""
    from haru.core.errors import HaruError
    from haru.log.eventlog import EventLog
    from haru.models.record import fetched_event, record_fetch

    by = f"cli:{os.environ.get('USER', 'unknown')}"
    try:
        log = await EventLog.open(args.nats_url, writer=by, creds=args.nats_creds, connect_timeout=2.0)
    except HaruError:
        if not args.json:
            print(
                f"haru: not recorded in the event log (no NATS at {args.nats_url}); the files are in place",
                file=sys.stderr,
            )
        return ""
    try:
        seq = await record_fetch(log, args.fleet, fetched_event(result, model=args.reference, by=by))
        return f"seq {seq}"
    except HaruError as exc:
        print(f"haru: the pull succeeded but recording it failed: {exc}", file=sys.stderr)
        return ""
    finally:
        await log.close()
