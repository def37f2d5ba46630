"""The declarative fleet layout: JSON in, a validated `haru.core.specs.Layout` out.

Pure: no I/O except `load_layout`, which only reads the file. This module reads the fleet (its name,
uuid, policy, the domains mirroring each other); the document's structs and shared helpers are in
`layout_doc`, a domain's checks in `layout_domains`, its models' in `layout_models`, its `provision`
and `preemption_notice` in `layout_provision`. Every error is a
`haru.core.errors.LayoutError` carrying the JSON path of the offending value (`$.domains[1].gpus[0].memory`)
and the fix. The shape (documented with examples in docs/residency.md):

    {
      "_comment": "...",                       keys starting with "_" are comments, anywhere
      "fleet": "default",
      "policy": {"auto_failover": true, "sleep_residual_bytes": "512MiB", ...},
      "domains": [                             2..N, mirroring the same model ids (or one: no failover)
        {"name": "a", "provider": "static", "region": "local-1",
         "serving_url": "http://127.0.0.1:18601", "serve": "agent",
         "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB", "name": "L4"}],
         "slots": [
           {"name": "chat", "gpu": 0, "models": [
              {"name": "qwen3.6:27b", "runtime": "vllm", "vram": "20GiB", "context_length": 32768,
               "port": 18100, "source": "Qwen/...", "url": "", "binary": [...], "args": [...], "env": {}}]},
           {"name": "lora", "kind": "training", "gpu": 0, "command": ["python", "train.py"],
            "checkpoint_dir": "~/ckpt", "vram": "8GiB", "grace_ms": 10000}]}]
    }

Sizes are integers (bytes) or strings with a unit: binary `KiB MiB GiB TiB`, decimal `KB MB GB TB`,
or `B`; `20GiB`, `44.2 GiB`, `512MiB`, `1.5GB`. Fractions are rounded to the nearest byte.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from haru.core.errors import InvalidName, LayoutError
from haru.core.layout_doc import LayoutDoc, clean, convert_at, size_at
from haru.core.layout_domains import domain_from
from haru.core.prices import layout_prices
from haru.core.specs import Domain, Layout, Policy, as_uuid
from haru.core.subjects import check_name

__all__ = ["parse_layout", "load_layout"]


# ------------------------------------------------------------------------------------- parse


def parse_layout(data: bytes | str | dict[str, Any]) -> Layout:
    """Parse and validate a layout. Raises LayoutError(message, path=..., fix=...)."""
    if isinstance(data, (bytes, bytearray, str)):
        try:
            raw = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise LayoutError(
                f"the layout is not valid JSON: {exc}", path="$", fix="check the file with `python -m json.tool`"
            ) from None
    else:
        raw = data
    cleaned = clean(raw)
    doc: LayoutDoc = convert_at(cleaned, LayoutDoc)
    try:
        fleet = check_name("fleet", doc.fleet)
    except InvalidName as exc:
        raise LayoutError(
            str(exc), path="$.fleet", fix="name the fleet with lowercase letters, digits, '_' or '-'"
        ) from None
    fleet_id = as_uuid(doc.uuid) if doc.uuid else ""
    if doc.uuid and not fleet_id:
        raise LayoutError(
            f"uuid {doc.uuid!r} is not a UUID",
            path="$.uuid",
            fix="write it like 6f1c9d2e-1b7a-4c3e-9f00-2a5d8c7b6e41, or leave it out (it is then derived "
            "from the fleet's name)",
        )
    policy = _policy(doc.policy)
    domains = [domain_from(d, i) for i, d in enumerate(doc.domains)]
    _check_fleet(domains, policy)
    prices = layout_prices(
        {
            d.spec.name: (doc.domains[i].price, f"$.domains[{i}].price")
            for i, d in enumerate(domains)
            if doc.domains[i].price is not None
        },
        {k: v for k, v in doc.gpu_prices.items() if not k.startswith("_")},
        {d.spec.name: [g.name for g in d.spec.gpus] for d in domains},
    )
    return Layout(fleet=fleet, uuid=fleet_id, policy=policy, domains=domains, prices=prices)


def load_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and parse a layout file. A missing file is a LayoutError naming it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise LayoutError(
            f"cannot read layout file {os.fspath(path)!r}: {exc.strerror}",
            path="$",
            fix="pass the path of a layout JSON file, e.g. deploy/examples/demo-fleet.json",
        ) from None
    return parse_layout(data)


def _policy(raw: dict[str, Any]) -> Policy:
    values = dict(raw)
    for key in values:
        if key.endswith("_bytes"):
            values[key] = size_at(values[key], f"$.policy.{key}", key)
    policy = convert_at(values, Policy, "$.policy")
    return policy


def _check_fleet(domains: list[Domain], policy: Policy | None = None) -> None:
    """A fleet has one domain (no failover) or 2..N that mirror each other: every domain declares the
    same model ids as the first, so whichever standby is promoted serves what the active serves.
    `policy.standby_order`, when given, names declared domains, each once."""
    if not domains:
        raise LayoutError(
            "a fleet has at least one failure domain; this layout declares 0",
            path="$.domains",
            fix="declare a domain with its GPUs and models (and more that mirror it, for failover)",
        )
    seen: dict[str, int] = {}
    for i, d in enumerate(domains):
        if d.spec.name in seen:
            raise LayoutError(
                f"domains {seen[d.spec.name]} and {i} are both named {d.spec.name!r}",
                path=f"$.domains[{i}].name",
                fix="give every domain of a fleet its own name",
            )
        seen[d.spec.name] = i
    if policy is not None:
        listed: set[str] = set()
        for i, name in enumerate(policy.standby_order):
            if name not in seen:
                raise LayoutError(
                    f"standby_order names {name!r}, which is not a domain of this fleet",
                    path=f"$.policy.standby_order[{i}]",
                    fix="name declared domains (" + ", ".join(seen) + "), most preferred first",
                )
            if name in listed:
                raise LayoutError(
                    f"standby_order names {name!r} twice",
                    path=f"$.policy.standby_order[{i}]",
                    fix="name each domain once",
                )
            listed.add(name)
    if len(domains) == 1:
        return  # a single-domain fleet (`haru serve`): routed to its one domain, with nothing to fail over to
    first = domains[0]
    mf = [m.name for m in first.models]
    for i, other in enumerate(domains[1:], start=1):
        mo = [m.name for m in other.models]
        if set(mf) == set(mo):
            continue
        only_first = [m for m in mf if m not in set(mo)]
        only_other = [m for m in mo if m not in set(mf)]
        if only_first:
            message = (
                f"domain {other.spec.name!r} does not mirror {', '.join(map(repr, only_first))} "
                f"declared on {first.spec.name!r}"
            )
            path = f"$.domains[{i}].slots"
        else:
            message = (
                f"domain {first.spec.name!r} does not mirror {', '.join(map(repr, only_other))} "
                f"declared on {other.spec.name!r}"
            )
            path = "$.domains[0].slots"
        raise LayoutError(
            message,
            path=path,
            fix="declare the same model ids on every domain: any standby must be able to serve what the active serves",
        )
