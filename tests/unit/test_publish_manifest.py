"""The publish manifest a finished training run leaves, and what keeps one from being published."""

from __future__ import annotations

import json

import pytest

from haru.core import publish_manifest as pm

GOOD = {
    "base_model": "m1",
    "adapter": "twice",
    "version": "20261206-abc123",
    "adapter_dir": "adapter",
    "rank": 4,
    "data": "/data/d.jsonl",
    "data_digest": "sha256:" + "0" * 64,
    "metrics": {"steps": 20, "loss": 1.5, "held_out_loss": 1.7},
}
FILES = pm.ADAPTER_FILES


def manifest(**changes) -> pm.PublishManifest:
    return pm.read(json.dumps({**GOOD, **changes}).encode())


def test_a_good_manifest_has_no_problems_and_names_its_object():
    m = manifest()
    assert pm.problems(m, models=["m1"], files=FILES, config_rank=4) == []
    assert pm.object_name("f", m) == "f/m1:twice/20261206-abc123"
    assert m.metrics["held_out_loss"] == 1.7


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"rank": 0}, "Expected `int` >= 1 - at `$.rank`"),
        ({"adapter": "a:b"}, "at `$.adapter`"),
        ({"version": "../x"}, "at `$.version`"),
        ({"data_digest": "md5:1"}, "at `$.data_digest`"),
        ({"metrics": {"loss": "low"}}, "at `$.metrics[...]`"),
    ],
)
def test_bad_fields_are_refused_with_their_path(changes, said):
    with pytest.raises(pm.ManifestError, match=r"publish.json: .*") as info:
        manifest(**changes)
    assert said in str(info.value)


def test_a_missing_field_and_not_json_are_refused():
    with pytest.raises(pm.ManifestError, match="Object missing required field `rank`"):
        pm.read(json.dumps({k: v for k, v in GOOD.items() if k != "rank"}).encode())
    with pytest.raises(pm.ManifestError, match="is not JSON"):
        pm.read(b'{"base_model": ')


def test_problems_name_the_field_the_value_and_the_fix():
    m = manifest()
    assert pm.problems(m, models=["m2"], files=FILES, config_rank=4) == [
        "base_model 'm1' is not a model this domain serves (m2); pass the declared model id the adapter was trained on"
    ]
    assert "has no adapter_model.safetensors" in pm.problems(m, models=["m1"], files=FILES[:1], config_rank=4)[0]
    assert pm.problems(m, models=["m1"], files=FILES, config_rank=8) == [
        "rank 4 disagrees with adapter_config.json's r = 8"
    ]
    assert "not a PEFT LoRA config" in pm.problems(m, models=["m1"], files=FILES, config_rank=None)[0]
    outside = manifest(adapter_dir="../elsewhere")
    assert (
        "must be a folder inside the checkpoint directory"
        in pm.problems(outside, models=["m1"], files=FILES, config_rank=4)[0]
    )
