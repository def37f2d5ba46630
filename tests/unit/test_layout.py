"""Layout parsing: sizes, the example files, and every validation error with its path and fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from haru.core.errors import LayoutError
from haru.core.layout import load_layout, parse_layout
from haru.core.sizes import GiB, MiB, parse_size

ROOT = Path(__file__).resolve().parents[2]


def base() -> dict:
    def domain(name: str, port: int) -> dict:
        return {
            "name": name,
            "region": f"r-{name}",
            "serving_url": f"http://127.0.0.1:{port}",
            "gpus": [{"index": 0, "memory": "24GiB", "reserve": "2GiB"}],
            "slots": [
                {
                    "name": "chat",
                    "gpu": 0,
                    "models": [
                        {"name": "qwen3.6:27b", "vram": "10GiB", "port": port + 1},
                        {"name": "Meta/Llama-3.1-8B", "vram": "8GiB", "port": port + 2},
                    ],
                },
                {
                    "name": "lora",
                    "kind": "training",
                    "gpu": 0,
                    "command": ["python", "t.py"],
                    "checkpoint_dir": "/tmp/ck",
                    "vram": "4GiB",
                },
            ],
        }

    return {
        "_comment": "test",
        "fleet": "f1",
        "policy": {"heartbeat_timeout_ms": 1000},
        "domains": [domain("a", 18600), domain("b", 18700)],
    }


def error(doc) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        parse_layout(doc if isinstance(doc, (str, bytes)) else copy.deepcopy(doc))
    assert info.value.fix, "every layout error says how to fix it"
    return info.value


@pytest.mark.parametrize(
    "text,expected",
    [
        (0, 0),
        (1234, 1234),
        ("20GiB", 20 * GiB),
        ("44.2 GiB", round(44.2 * GiB)),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        ("3 KiB", 3072),
        ("2tb", 2 * 10**12),
        (" 7 B ", 7),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "12 parsecs", "-1GiB", -5, True, 1.5, "1.2.3GiB"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_parses_a_valid_layout_in_every_input_form():
    doc = base()
    for data in (doc, json.dumps(doc), json.dumps(doc).encode()):
        layout = parse_layout(copy.deepcopy(data) if isinstance(data, dict) else data)
        assert layout.fleet == "f1"
        assert layout.policy.heartbeat_timeout_ms == 1000
        a = layout.domain("a")
        assert a is not None and a.spec.gpus[0].memory_bytes == 24 * GiB and a.spec.gpus[0].reserve_bytes == 2 * GiB
        assert [m.name for m in a.models] == ["qwen3.6:27b", "Meta/Llama-3.1-8B"]
        assert a.models[0].slot == "chat" and a.models[0].vram_bytes == 10 * GiB and a.models[0].port == 18601
        assert a.training[0].slot == "lora" and a.training[0].vram_bytes == 4 * GiB
        assert a.training[0].command == ["python", "t.py"]


def test_examples_parse():
    hearth = load_layout(ROOT / "deploy/examples/hearth.json")
    demo = load_layout(ROOT / "deploy/examples/demo-fleet.json")
    assert [d.spec.name for d in demo.domains] == ["a", "b"] and demo.fleet == "default"
    assert len(hearth.domains[0].models) == 5


def test_policy_sizes_accept_units():
    doc = base()
    doc["policy"]["sleep_residual_bytes"] = "1GiB"
    assert parse_layout(doc).policy.sleep_residual_bytes == GiB


def mutate(fn):
    doc = base()
    fn(doc)
    return doc


CASES = [
    # (what, mutation, path, words in the message)
    (
        "bad memory size",
        lambda d: d["domains"][1]["gpus"][0].__setitem__("memory", "lots"),
        "$.domains[1].gpus[0].memory",
        "lots",
    ),
    (
        "memory wrong type",
        lambda d: d["domains"][1]["gpus"][0].__setitem__("memory", [1]),
        "$.domains[1].gpus[0].memory",
        "Expected",
    ),
    (
        "index wrong type",
        lambda d: d["domains"][0]["gpus"][0].__setitem__("index", "0"),
        "$.domains[0].gpus[0].index",
        "Expected `int`",
    ),
    (
        "reserve above memory",
        lambda d: d["domains"][0]["gpus"][0].__setitem__("reserve", "30GiB"),
        "$.domains[0].gpus[0].reserve",
        "exceeds",
    ),
    (
        "duplicate model",
        lambda d: d["domains"][0]["slots"][0]["models"].append({"name": "qwen3.6:27b", "vram": "1GiB"}),
        "$.domains[0].slots[0].models[2].name",
        "twice",
    ),
    (
        "model on a missing GPU",
        lambda d: d["domains"][1]["slots"][0].__setitem__("gpu", 3),
        "$.domains[1].slots[0].gpu",
        "GPU 3",
    ),
    (
        "training on a missing GPU",
        lambda d: d["domains"][0]["slots"][1].__setitem__("gpu", 1),
        "$.domains[0].slots[1].gpu",
        "GPU 1",
    ),
    (
        "domains do not mirror",
        lambda d: d["domains"][1]["slots"][0]["models"].pop(),
        "$.domains[1].slots",
        "Meta/Llama-3.1-8B",
    ),
    (
        "third domain does not mirror",
        lambda d: (
            d["domains"].append(copy.deepcopy(d["domains"][0]) | {"name": "c"}),
            d["domains"][2]["slots"][0]["models"].pop(),
        ),
        "$.domains[2].slots",
        "domain 'c' does not mirror",
    ),
    ("no domain", lambda d: d["domains"].clear(), "$.domains", "at least one failure domain"),
    ("same domain name", lambda d: d["domains"][1].__setitem__("name", "a"), "$.domains[1].name", "both named"),
    (
        "same name as the first, third",
        lambda d: d["domains"].append(copy.deepcopy(d["domains"][0])),
        "$.domains[2].name",
        "domains 0 and 2 are both named 'a'",
    ),
    (
        "standby_order names an unknown domain",
        lambda d: d["policy"].__setitem__("standby_order", ["b", "z"]),
        "$.policy.standby_order[1]",
        "'z', which is not a domain",
    ),
    (
        "standby_order names a domain twice",
        lambda d: d["policy"].__setitem__("standby_order", ["b", "b"]),
        "$.policy.standby_order[1]",
        "twice",
    ),
    (
        "empty model id",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("name", ""),
        "$.domains[0].slots[0].models[0].name",
        "empty",
    ),
    (
        "whitespace model id",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("name", "qwen 3"),
        "$.domains[0].slots[0].models[0].name",
        "whitespace",
    ),
    ("bad domain name", lambda d: d["domains"][0].__setitem__("name", "East"), "$.domains[0].name", "'east'"),
    ("reserved domain name", lambda d: d["domains"][0].__setitem__("name", "decl"), "$.domains[0].name", "reserved"),
    ("bad fleet name", lambda d: d.__setitem__("fleet", "my fleet"), "$.fleet", "fleet name"),
    (
        "bad slot name",
        lambda d: d["domains"][0]["slots"][0].__setitem__("name", "Chat.1"),
        "$.domains[0].slots[0].name",
        "slot name",
    ),
    ("unknown top key", lambda d: d.__setitem__("domain", []), "$.domain", "fleet, uuid, policy, domains"),
    (
        "unknown model key",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("vram_gb", 3),
        "$.domains[0].slots[0].models[0].vram_gb",
        "context_length",
    ),
    (
        "unknown policy key",
        lambda d: d["policy"].__setitem__("heartbeat_ms", 3),
        "$.policy.heartbeat_ms",
        "heartbeat_timeout_ms",
    ),
    (
        "models key on a training slot",
        lambda d: d["domains"][0]["slots"][1].__setitem__("models", []),
        "$.domains[0].slots[1].models",
        "checkpoint_dir",
    ),
    (
        "duplicate port",
        lambda d: d["domains"][1]["slots"][0]["models"][1].__setitem__("port", 18701),
        "$.domains[1].slots[0].models[1].port",
        "18701",
    ),
    (
        "duplicate gpu index",
        lambda d: d["domains"][0]["gpus"].append({"index": 0, "memory": "8GiB"}),
        "$.domains[0].gpus[1].index",
        "twice",
    ),
    (
        "duplicate slot",
        lambda d: d["domains"][0]["slots"][1].__setitem__("name", "chat"),
        "$.domains[0].slots[1].name",
        "twice",
    ),
    (
        "no vram",
        lambda d: d["domains"][0]["slots"][0]["models"][0].pop("vram"),
        "$.domains[0].slots[0].models[0].vram",
        "VRAM",
    ),
    (
        "training without command",
        lambda d: d["domains"][0]["slots"][1].__setitem__("command", []),
        "$.domains[0].slots[1].command",
        "command",
    ),
    (
        "unknown runtime",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("runtime", "ollama"),
        "$.domains[0].slots[0].models[0].runtime",
        "ollama",
    ),
    ("no gpus", lambda d: d["domains"][0].__setitem__("gpus", []), "$.domains[0].gpus", "no GPUs"),
    (
        "external without url",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("runtime", "external"),
        "$.domains[0].slots[0].models[0].url",
        "url",
    ),
    (
        "policy negative",
        lambda d: d["policy"].__setitem__("degraded_grace_ms", -1),
        "$.policy.degraded_grace_ms",
        "Expected `int` >= 0",
    ),
    (
        "gpu index negative",
        lambda d: d["domains"][0]["gpus"][0].__setitem__("index", -1),
        "$.domains[0].gpus[0].index",
        "Expected `int` >= 0",
    ),
    (
        "model port out of range",
        lambda d: d["domains"][0]["slots"][0]["models"][0].__setitem__("port", 70000),
        "$.domains[0].slots[0].models[0].port",
        "Expected `int` <= 65535",
    ),
    (
        "serving_url not a URL",
        lambda d: d["domains"][0].__setitem__("serving_url", "127.0.0.1:8600"),
        "$.domains[0].serving_url",
        "http",
    ),
    (
        "direct serving needs ports",
        lambda d: (
            d["domains"][0].update(serve="direct", network="private", expose_dev_endpoints=True),
            d["domains"][0]["slots"][0]["models"][1].pop("port"),
        ),
        "$.domains[0].slots[0].models[1].port",
        "direct",
    ),
    (
        "policy wrong type",
        lambda d: d["policy"].__setitem__("auto_failover", "yes"),
        "$.policy.auto_failover",
        "Expected `bool`",
    ),
]


@pytest.mark.parametrize("what,fn,path,words", CASES, ids=[c[0] for c in CASES])
def test_layout_errors_carry_path_and_fix(what, fn, path, words):
    err = error(mutate(fn))
    assert err.path == path, str(err)
    assert words in str(err), str(err)
    assert path in str(err)


def test_model_ids_match_exactly_case_and_all():
    doc = base()
    doc["domains"][1]["slots"][0]["models"][1]["name"] = "meta/llama-3.1-8b"
    err = error(doc)
    assert "Meta/Llama-3.1-8B" in str(err)


def test_not_json():
    err = error(b"{not json")
    assert err.path == "$" and "JSON" in str(err)


def test_layout_must_be_an_object():
    err = error("[1, 2]")
    assert err.path == "$"


def test_missing_file(tmp_path):
    with pytest.raises(LayoutError) as info:
        load_layout(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)


def test_comments_anywhere_are_ignored():
    doc = base()
    doc["domains"][0]["_note"] = "east"
    doc["domains"][0]["gpus"][0]["_note"] = "A6000"
    assert parse_layout(doc).domain("a") is not None


def test_a_single_domain_fleet_is_a_layout():
    """`haru serve`'s fleet: one domain, routed to, with nothing to fail over to."""
    doc = mutate(lambda d: d["domains"].pop())
    layout = parse_layout(doc)
    assert [d.spec.name for d in layout.domains] == ["a"]


@pytest.mark.parametrize("n", [3, 4])
def test_n_domains_that_mirror_the_first_parse_in_declaration_order(n: int) -> None:
    doc = base()
    for i in range(2, n):
        doc["domains"].append(copy.deepcopy(doc["domains"][1]) | {"name": f"d{i}"})
    doc["policy"]["standby_order"] = [f"d{n - 1}", "b"]
    layout = parse_layout(doc)
    assert [d.spec.name for d in layout.domains] == ["a", "b", *[f"d{i}" for i in range(2, n)]]
    assert layout.policy.standby_order == [f"d{n - 1}", "b"]
    assert {m.name for m in layout.domains[-1].models} == {m.name for m in layout.domains[0].models}
