"""A domain's provision block, as the layout checks it and as the YAML SkyPilot and SkyServe are given.

Every YAML the drivers would submit is read back with PyYAML and validated with SkyPilot's own schema
and task parser (the `skypilot` package is a test dependency), so a field SkyPilot would refuse fails
here, not at a 3 a.m. launch.
"""

from __future__ import annotations

import copy
import json

import pytest
import sky  # the skypilot package, a test dependency: SkyPilot's own schema and task parser
import yaml
from sky.utils import common_utils, schemas

from haru.core.errors import LayoutError
from haru.core.layout import load_layout, parse_layout
from haru.provision import (
    NotProvisionable,
    placements,
    service_config,
    service_yaml,
    submitted_yaml,
    task_config,
    task_yaml,
    yamltext,
)
from haru.provision.skypilot import DEFAULT_RUN, agent_config
from tests.support.provision import EXAMPLE, ROOT


def sky_validates_task(config: dict) -> sky.Task:
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    return sky.Task.from_yaml_config(copy.deepcopy(config))


def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def domain(raw: dict, i: int):
    return parse_layout(raw).domains[i].spec


@pytest.mark.timeout(60)
def test_the_examples_yaml_is_what_skypilot_accepts():
    layout = load_layout(EXAMPLE)
    a, b = (d.spec for d in layout.domains)

    text = task_yaml(layout.fleet, a)
    assert yaml.safe_load(text) == task_config(layout.fleet, a)
    task = sky_validates_task(yaml.safe_load(text))
    assert task.name == "haru-cloud-a"
    (res,) = task.resources
    assert (str(res.cloud), res.region, res.use_spot, res.disk_size) == ("AWS", "us-east-1", True, 200)
    assert res.accelerators == {"L4": 1}
    assert res.ports == ["8600"]
    assert task.run == DEFAULT_RUN
    assert json.loads(task.envs["HARU_AGENT_CONFIG"]) == {
        "fleet": "cloud",
        "domain": "a",
        "nats_url": "tls://nats.cloud.example:4222",
        "gpus": "nvml",
        "serving": {"host": "0.0.0.0", "port": 8600},
        "role": "auto",
        "state_dir": "__HOME__/.haru/state",
        "nats_creds": "__HOME__/.haru/agent.creds",
    }
    # secrets are named, never valued, in what Haru writes
    assert yaml.safe_load(text)["secrets"] == {
        "HARU_AGENT_NATS_CREDS": None,
        "HARU_SERVING_TOKEN": None,
        "HF_TOKEN": None,
    }

    text = service_yaml(layout.fleet, b)
    config = yaml.safe_load(text)
    assert config == service_config(layout.fleet, b)
    common_utils.validate_schema(config["service"], schemas.get_service_schema(), "Invalid service YAML: ")
    task = sky_validates_task(config)
    assert task.service is not None
    assert task.service.readiness_path == "/ready"
    assert task.service.initial_delay_seconds == 1800
    assert task.service.min_replicas == 1
    (res,) = task.resources
    assert (str(res.cloud), res.region, res.use_spot) == ("GCP", "europe-west4", False)
    assert submitted_yaml(layout.fleet, b) == text


@pytest.mark.timeout(60)
def test_regions_zones_and_any_of_are_what_skypilot_accepts():
    raw = example()
    raw["domains"][0]["provision"]["regions"] = []
    raw["domains"][0]["provision"]["zones"] = ["us-east-1a", "us-east-1b"]
    a = domain(raw, 0)
    assert [p.zone for p in placements(a)] == ["us-east-1a", "us-east-1b"]
    (res,) = sky_validates_task(task_config("cloud", a, placements(a)[1])).resources
    assert res.zone == "us-east-1b"

    raw = example()
    raw["domains"][1]["provision"]["regions"] = ["europe-west4", "us-central1"]
    b = domain(raw, 1)
    config = service_config("cloud", b)
    assert config["resources"]["any_of"] == [
        {"cloud": "gcp", "region": "europe-west4"},
        {"cloud": "gcp", "region": "us-central1"},
    ]
    task = sky_validates_task(yaml.safe_load(yamltext.dump(config)))
    assert {r.region for r in task.resources} == {"europe-west4", "us-central1"}


def test_placements_follow_the_declared_order_and_put_the_failed_region_last():
    a = domain(example(), 0)
    assert [p.region for p in placements(a)] == ["us-east-1", "us-west-2"]
    assert [p.region for p in placements(a, avoid=("us-east-1",))] == ["us-west-2", "us-east-1"]
    raw = example()
    raw["domains"][0]["provision"].pop("regions")
    assert [p.region for p in placements(domain(raw, 0))] == ["us-east-1"]  # the domain's region


def test_a_generation_names_a_replacement_cluster():
    a = domain(example(), 0)
    assert task_config("cloud", a, generation="0a1b2c")["name"] == "haru-cloud-a-r0a1b2c"
    from haru.provision.skypilot import owns

    assert owns("cloud", a, "haru-cloud-a") and owns("cloud", a, "haru-cloud-a-r0a1b2c")
    assert not owns("cloud", a, "haru-cloud-a-b") and not owns("cloud", a, "haru-cloud-ab")


def test_no_creds_secret_no_creds_path_and_a_declared_run_is_used_as_is():
    raw = example()
    p = raw["domains"][0]["provision"]
    p["secrets"] = ["HF_TOKEN"]
    p["run"] = "haru agent --config /etc/haru/agent.json"
    a = domain(raw, 0)
    assert "nats_creds" not in agent_config("cloud", a)
    config = task_config("cloud", a)
    assert config["run"] == "haru agent --config /etc/haru/agent.json"
    sky_validates_task(config)


def test_static_and_undeclared_domains_are_not_provisionable():
    raw = example()
    raw["domains"][0]["provider"] = "static"
    with pytest.raises(LayoutError) as info:
        parse_layout(raw)
    assert info.value.path == "$.domains[0].provision"
    raw["domains"][0].pop("provision")
    with pytest.raises(NotProvisionable, match="static host"):
        task_config("cloud", domain(raw, 0))
    raw = example()
    raw["domains"][0].pop("provision")
    with pytest.raises(NotProvisionable, match="declares no provision block"):
        task_config("cloud", domain(raw, 0))


@pytest.mark.parametrize(
    "where, value, path, words",
    [
        ("accelerators", "L4 x1", "$.domains[0].provision.accelerators", "NAME[:COUNT]"),
        ("regions", ["us east"], "$.domains[0].provision.regions[0]", "not a region"),
        ("regions", ["eu-west-1"], "$.domains[0].provision.regions", "not among provision.regions"),
        ("zones", ["us-east-1a"], "$.domains[0].provision.zones", "both regions and zones"),
        ("ports", [70000], "$.domains[0].provision.ports[0]", "Expected `int` <= 65535"),
        ("launch_timeout_s", 0, "$.domains[0].provision.launch_timeout_s", "Expected `int` >= 1"),
        ("envs", {"HARU_AGENT_CONFIG": "{}"}, "$.domains[0].provision.envs.HARU_AGENT_CONFIG", "cannot be used"),
        ("secrets", ["HF_HOME"], "$.domains[0].provision.secrets[0]", "both an env and a secret"),
        ("cluster", "My_Cluster", "$.domains[0].provision.cluster", "not a valid SkyPilot cluster name"),
        ("nats_url", "", "$.domains[0].provision.nats_url", "no NATS URL"),
        ("service", {"replicas": 2}, "$.domains[0].provision.service", "provider is skypilot"),
        ("use_spot", "yes", "$.domains[0].provision.use_spot", "Expected `bool`"),
        ("bogus", 1, "$.domains[0].provision.bogus", "unknown key"),
    ],
)
def test_a_bad_provision_block_is_refused_with_its_path(where, value, path, words):
    raw = example()
    raw["domains"][0]["provision"][where] = value
    with pytest.raises(LayoutError) as info:
        parse_layout(raw)
    assert info.value.path == path
    assert words in str(info.value)


def test_the_yaml_writer_round_trips_awkward_strings():
    value = {
        "a": "x: y # not a comment",
        "b": "multi\nline\n",
        "c": " leading\nspace",
        "d": "tab\there\nz",
        "e": ["", "yes", "null", "0123", "é"],
        "f": {},
        "g": [],
        "h": None,
        "i": [{"k": 1}, {"k": [True]}],
        "j": "two\nnewlines\n\n",
        "k": "no newline\nat end",
        "weird key": 1.5,
    }
    assert yaml.safe_load(yamltext.dump(value)) == value


def test_the_docs_show_the_yaml_the_examples_produce():
    from haru.provision import dry_run_text

    doc = (ROOT / "docs" / "provisioning.md").read_text()
    layout = load_layout(EXAMPLE)
    for d in layout.domains:
        assert dry_run_text("provision", layout.fleet, d.spec).rstrip("\n") in doc, (
            "regenerate docs/provisioning.md's YAML with `haru "
            f"provision {d.spec.name} --dry-run --layout {EXAMPLE.name}`"
        )
