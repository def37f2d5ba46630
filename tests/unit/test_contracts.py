"""The contracts users bring from the two systems Haru merges work as written (issue 29, fifth bullet):
hearth's `serve` flags and fleet.conf, a stable UUID per fleet, PORT as a fallback."""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC

import pytest

from haru.cli.serve import model_values
from haru.core.specs import GiB
from haru.up.serve import ServeError, hearth_model_flag, parse_fleet_conf, parse_model_flag


def _args(**kw) -> argparse.Namespace:
    base = dict(model=[], gguf="", safetensors="", vram="", fleet_conf=None, binary="")
    base.update(kw)
    return argparse.Namespace(**base)


def test_hearths_serve_flags_are_a_spelling_of_the_model_syntax(tmp_path):
    gguf = tmp_path / "muse.gguf"
    gguf.write_bytes(b"\0" * (GiB // 4))  # 0.25 GiB of weights
    # hearth serve --model muse --gguf ./muse.gguf --port 8080
    assert model_values(_args(model=["muse"], gguf=str(gguf)), tmp_path) == [f"muse=gguf:{gguf}:0.4"]
    flag = parse_model_flag(hearth_model_flag("muse", gguf=str(gguf)))
    assert (flag.name, flag.format, flag.source) == ("muse", "gguf", str(gguf))
    assert flag.vram_bytes == int(0.4 * GiB)  # the weights, and 25 % for the KV cache, rounded up to 0.1 GiB
    assert model_values(_args(model=["muse"], gguf=str(gguf), vram="20"), tmp_path) == [f"muse=gguf:{gguf}:20"]
    # hearth serve --model imagine-v8 --safetensors DIR
    st = tmp_path / "imagine"
    st.mkdir()
    (st / "config.json").write_text("{}")
    (st / "model.safetensors").write_bytes(b"\0" * (GiB // 2))
    assert model_values(_args(model=["imagine-v8"], safetensors=str(st)), tmp_path) == [
        f"imagine-v8=safetensors:{st}:0.7"
    ]


def test_hearths_spelling_says_what_is_wrong(tmp_path):
    with pytest.raises(ServeError, match="does not exist"):
        model_values(_args(model=["muse"], gguf=str(tmp_path / "nope.gguf")), tmp_path)
    with pytest.raises(ServeError, match="one NAME without '='"):
        model_values(_args(model=["a=x:1", "b=y:1"], gguf="x.gguf"), tmp_path)
    with pytest.raises(ServeError, match="--vram goes with"):
        model_values(_args(model=["a=x:1"], vram="3"), tmp_path)


def test_a_fleet_conf_is_hearths_one_line_per_model(tmp_path):
    conf = tmp_path / "fleet.conf"
    conf.write_text(
        "# the box's models, most important first\n\n"
        "model muse=/models/muse.gguf:20\n"
        "model imagine-v8=safetensors:/models/Interchained_imagine-v8:3@16384\n"
    )
    assert parse_fleet_conf(conf.read_text()) == [
        "muse=/models/muse.gguf:20",
        "imagine-v8=safetensors:/models/Interchained_imagine-v8:3@16384",
    ]
    assert model_values(_args(fleet_conf=str(conf)), tmp_path / "elsewhere") == parse_fleet_conf(conf.read_text())
    # With no --model, $HARU_HOME/fleet.conf is read (hearth reads $HEARTH_HOME/fleet.conf)
    assert model_values(_args(), tmp_path) == parse_fleet_conf(conf.read_text())
    assert model_values(_args(model=["x=/m.gguf:1"]), tmp_path) == ["x=/m.gguf:1"], "flags given: the conf is not read"
    with pytest.raises(ServeError, match="line 2: 'modle a=/a.gguf:1' is not a model line"):
        parse_fleet_conf("model b=/b.gguf:1\nmodle a=/a.gguf:1\n")
    with pytest.raises(ServeError, match="no VRAM size"):
        parse_fleet_conf("model a=/a.gguf\n")
    with pytest.raises(ServeError, match="declares no model"):
        parse_fleet_conf("# nothing\n")


def test_port_is_honoured_as_the_gateways_fallback():
    from haru.gateway.config import from_env

    assert from_env({"PORT": "9123"}).port == 9123
    assert from_env({"PORT": "9123", "HARU_GATEWAY_PORT": "9200"}).port == 9200
    assert from_env({}).port == 8700


def test_database_url_runs_the_postgres_read_model_beside_haru_up():
    from haru.up.compose import read_model_dsn

    assert read_model_dsn({"DATABASE_URL": "postgresql://db/haru"}) == "postgresql://db/haru"
    assert read_model_dsn({"DATABASE_URL": "postgresql://a", "HARU_DATABASE_URL": "postgresql://b"}) == "postgresql://b"
    assert read_model_dsn({}) == ""


def test_a_fleet_uuid_is_derived_from_its_name_or_declared():
    from haru.core.errors import LayoutError
    from haru.core.layout import parse_layout
    from haru.core.specs import fleet_uuid

    assert fleet_uuid("default") == fleet_uuid("default") != fleet_uuid("other")
    assert uuid.UUID(fleet_uuid("default")).version == 5
    one = [
        {
            "name": "a",
            "gpus": [{"index": 0, "memory": "24GiB"}],
            "slots": [{"name": "chat", "gpu": 0, "models": [{"name": "m", "source": "/m.gguf", "vram": "1GiB"}]}],
        }
    ]
    assert parse_layout({"fleet": "f", "domains": one}).uuid == ""  # none declared: derived where recorded
    declared = "6F1C9D2E-1B7A-4C3E-9F00-2A5D8C7B6E41"
    assert parse_layout({"fleet": "f", "uuid": declared, "domains": one}).uuid == declared.lower()
    with pytest.raises(LayoutError, match=r"\$\.uuid"):
        parse_layout({"fleet": "f", "uuid": "not-a-uuid", "domains": one})


def test_projector_replicas_default_is_the_clusters_as_readme_says(monkeypatch):
    """README: 3 on a cluster of three or more, else 1. The flag's default leaves that to ensure()."""
    from haru.cli import build_parser

    monkeypatch.delenv("HARU_REPLICAS", raising=False)
    assert build_parser().parse_args(["projector"]).replicas is None  # ensure(replicas=None) decides by cluster size
    monkeypatch.setenv("HARU_REPLICAS", "5")
    assert build_parser().parse_args(["projector"]).replicas == 5


def test_a_recorded_fleet_uuid_never_changes():
    from datetime import datetime

    from haru.core.apply import diff, fold_declarations
    from haru.core.errors import LayoutError
    from haru.core.events import FleetDeclared
    from haru.core.layout import parse_layout
    from haru.core.planner import plan
    from haru.core.specs import Policy, fleet_uuid

    one = [
        {
            "name": "a",
            "gpus": [{"index": 0, "memory": "24GiB"}],
            "slots": [{"name": "chat", "gpu": 0, "models": [{"name": "m", "source": "/m.gguf", "vram": "1GiB"}]}],
        }
    ]
    now = datetime.now(UTC)
    layout = parse_layout({"fleet": "f", "domains": one})
    first = diff(fold_declarations([]), layout, plan(layout), now)
    assert isinstance(first[0], FleetDeclared) and first[0].uuid == fleet_uuid("f")  # recorded
    current = fold_declarations(first)
    assert diff(current, layout, plan(layout), now) == []  # re-applying changes nothing
    other = parse_layout({"fleet": "f", "uuid": "6f1c9d2e-1b7a-4c3e-9f00-2a5d8c7b6e41", "domains": one})
    with pytest.raises(LayoutError, match="never changes"):
        diff(current, other, plan(other), now)
    declared = diff(fold_declarations([]), other, plan(other), now)
    assert declared[0].uuid == "6f1c9d2e-1b7a-4c3e-9f00-2a5d8c7b6e41"
    assert diff(fold_declarations(declared), layout, plan(layout), now) == [], "leaving uuid out keeps the recorded one"
    # an older log, recorded before UUIDs: the derived one is the recorded one
    old = fold_declarations([FleetDeclared(at=now, fleet="f", policy=Policy())])
    assert old.uuid == fleet_uuid("f")
