"""The SkyPilot and SkyServe drivers against a fake `sky` executable (tests/support/fake_sky.py), run as a real
child process through the real `SubprocessExec`: success, a capacity error then the next region, a
hang past the timeout, a cluster already up after a crash, a failed teardown, a missing secret."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import yaml

from haru.core.layout import load_layout
from haru.host.procfs import pid_alive
from haru.provision import (
    CapacityError,
    LaunchFailed,
    SecretMissing,
    SkyPilot,
    SkyServe,
    SkyTimeout,
    SkyUnavailable,
    SubprocessExec,
    task_config,
)
from haru.provision.errors import TeardownFailed
from tests.support.fake_sky import FakeSky, sha12
from tests.support.provision import EXAMPLE

ENV = {
    "HARU_AGENT_NATS_CREDS": "-----BEGIN NATS USER JWT-----\nfake\n",
    "HARU_SERVING_TOKEN": "serving-token-fake",
    "HF_TOKEN": "hf_fake",
}


@pytest.fixture
def layout():
    return load_layout(EXAMPLE)


@pytest.fixture
def fake(tmp_path):
    return FakeSky(tmp_path / "sky", watch_env=("HARU_AGENT_NATS_CREDS", "HARU_SERVING_TOKEN", "HF_TOKEN"))


def with_provision(spec, **changes):
    return msgspec.structs.replace(spec, provision=msgspec.structs.replace(spec.provision, **changes))


def driver(fake, env=ENV):
    return SkyPilot(SubprocessExec(kill_grace_s=1), sky=str(fake.path), environ=env)


async def test_launch_status_cost_down(layout, fake):
    a = layout.domains[0].spec
    sky = driver(fake)
    result = await sky.launch(layout.fleet, a)
    assert (result.cluster, result.found, result.placement.region) == ("haru-cloud-a", False, "us-east-1")
    assert [x.outcome for x in result.attempts] == ["launched"]
    assert fake.commands() == ["status", "launch"]
    launch = fake.calls()[1]
    assert launch["argv"][:6] == ["launch", "--yes", "--cluster", "haru-cloud-a", "--detach-run", "--secret"]
    assert "HARU_AGENT_NATS_CREDS" in launch["argv"] and "HF_TOKEN" in launch["argv"]
    # the secrets' values reach `sky` in its environment, never on its command line or in the YAML
    assert launch["env"] == {k: sha12(v) for k, v in ENV.items()}
    assert not any(v in " ".join(launch["argv"]) for v in ENV.values())
    submitted = fake.state()["launched"][0]["yaml"]
    assert yaml.safe_load(submitted) == task_config(layout.fleet, a)
    assert not any(v.strip() in submitted for v in ENV.values())

    status = await sky.status("haru-cloud-a")
    assert (status.status, status.region) == ("UP", "us-east-1")
    assert await sky.cost("haru-cloud-a") == 1.25
    report = await sky.cost_report("haru-cloud-a")
    assert report is not None and (report.total, report.seconds) == ("1.25", 3600.0)
    assert await sky.down("haru-cloud-a") is True
    assert await sky.status("haru-cloud-a") is None
    calls = len(fake.calls())
    assert await sky.down("haru-cloud-a") is False  # already gone: no `sky down` at all
    assert fake.commands()[calls:] == ["status"]


async def test_a_capacity_error_moves_to_the_next_region(layout, fake):
    fake.script(launch_script=["capacity", "ok"])
    seen = []
    result = await driver(fake).launch(layout.fleet, layout.domains[0].spec, on_attempt=seen.append)
    assert result.placement.region == "us-west-2"
    assert [(a.placement.region, a.outcome) for a in result.attempts] == [
        ("us-east-1", "capacity"),
        ("us-west-2", "launched"),
    ]
    assert seen == result.attempts
    assert "ResourcesUnavailableError" in result.attempts[0].message
    assert fake.commands() == ["status", "launch", "status", "launch"]
    assert fake.state()["clusters"]["haru-cloud-a"]["region"] == "us-west-2"


async def test_every_region_out_of_capacity_is_one_error_naming_each(layout, fake):
    fake.script(launch_script=["capacity", "capacity"])
    with pytest.raises(LaunchFailed) as info:
        await driver(fake).launch(layout.fleet, layout.domains[0].spec)
    assert [a.outcome for a in info.value.attempts] == ["capacity", "capacity"]
    assert "us-east-1 (capacity), aws/us-west-2 (capacity)" in str(info.value)
    assert fake.state()["clusters"] == {}


async def test_another_failure_is_not_retried_elsewhere(layout, fake):
    fake.script(launch_script=["fail", "ok"])
    with pytest.raises(LaunchFailed, match="not for want of capacity") as info:
        await driver(fake).launch(layout.fleet, layout.domains[0].spec)
    assert [a.outcome for a in info.value.attempts] == ["failed"]
    assert fake.commands().count("launch") == 1
    assert not isinstance(info.value, CapacityError)


@pytest.mark.timeout(60)
async def test_a_hung_launch_is_killed_cleaned_up_and_the_next_region_tried(layout, fake):
    fake.script(launch_script=["hang", "ok"])
    a = with_provision(layout.domains[0].spec, launch_timeout_s=2)
    started = time.monotonic()
    result = await driver(fake).launch(layout.fleet, a)
    assert [(x.placement.region, x.outcome) for x in result.attempts] == [
        ("us-east-1", "timeout"),
        ("us-west-2", "launched"),
    ]
    assert "ran past its 2 s bound" in result.attempts[0].message
    assert time.monotonic() - started < 60
    # the hung launch's own child went with it (the whole process group), and what it left was taken down
    pid = fake.hang_pid()
    assert pid is not None and not pid_alive(pid)
    assert fake.commands() == ["status", "launch", "status", "status", "down", "launch"]
    assert fake.state()["clusters"]["haru-cloud-a"]["status"] == "UP"


async def test_a_cluster_already_up_after_a_crash_is_found_not_launched_again(layout, fake):
    fake.add_cluster("haru-cloud-a", "UP", region="us-west-2")
    result = await driver(fake).launch(layout.fleet, layout.domains[0].spec)
    assert result.found is True
    assert result.placement.region == "us-west-2"
    assert [a.outcome for a in result.attempts] == ["found"]
    assert "launch" not in fake.commands()


async def test_a_launch_still_under_way_is_waited_for_not_repeated(layout, fake):
    fake.add_cluster("haru-cloud-a", "INIT", region="us-east-1", up_after_s=1.0)
    sky = SkyPilot(SubprocessExec(kill_grace_s=1), sky=str(fake.path), environ=ENV, poll_s=0.2)
    result = await sky.launch(layout.fleet, layout.domains[0].spec)
    assert result.found is True and [a.outcome for a in result.attempts] == ["found"]
    assert "launch" not in fake.commands() and "down" not in fake.commands()


async def test_a_stopped_cluster_is_taken_down_and_launched_afresh(layout, fake):
    fake.add_cluster("haru-cloud-a", "STOPPED", region="us-west-2")
    result = await driver(fake).launch(layout.fleet, layout.domains[0].spec)
    assert result.found is False and result.placement.region == "us-east-1"
    assert fake.commands() == ["status", "status", "down", "launch"]


async def test_a_missing_secret_is_named_before_anything_launches(layout, fake):
    with pytest.raises(SecretMissing, match="HF_TOKEN is not set"):
        await driver(fake, env={"HARU_AGENT_NATS_CREDS": "x", "HARU_SERVING_TOKEN": "y"}).launch(
            layout.fleet, layout.domains[0].spec
        )
    assert "launch" not in fake.commands()


async def test_a_failed_teardown_says_the_cluster_may_still_run_and_a_retry_finishes_it(layout, fake):
    fake.add_cluster("haru-cloud-a", "UP")
    fake.script(down_script=["fail"])
    sky = driver(fake)
    with pytest.raises(TeardownFailed, match="may still be running"):
        await sky.down("haru-cloud-a")
    assert (await sky.status("haru-cloud-a")).status == "UP"
    assert await sky.down("haru-cloud-a") is True
    assert await sky.status("haru-cloud-a") is None


async def test_no_sky_executable_is_a_clear_error(tmp_path):
    sky = SkyPilot(SubprocessExec(), sky=str(tmp_path / "no-such-sky"), environ={})
    with pytest.raises(SkyUnavailable, match="pip install skypilot"):
        await sky.status("x")


async def test_skyserve_up_status_down(layout, fake):
    b = layout.domains[1].spec
    serve = SkyServe(SubprocessExec(kill_grace_s=1), sky=str(fake.path), environ=ENV)
    assert await serve.status("haru-cloud-b") is None
    result = await serve.up(layout.fleet, b)
    assert (result.service, result.found, result.endpoint) == ("haru-cloud-b", False, "34.1.2.3:30001")
    up = [c for c in fake.calls() if c["argv"][:2] == ["serve", "up"]][0]
    assert up["argv"][2:5] == ["--yes", "--service-name", "haru-cloud-b"]
    assert up["env"] == {k: sha12(v) for k, v in ENV.items()}
    submitted = yaml.safe_load(fake.state()["services"]["haru-cloud-b"]["yaml"])
    assert submitted["service"]["replicas"] == 1 and submitted["resources"]["ports"] == 8600

    status = await serve.status("haru-cloud-b")
    # no replica has answered SkyServe's readiness probe (no host runs here): not READY, as SkyServe says
    assert (status.status, status.endpoint) == ("REPLICA_INIT", "34.1.2.3:30001")
    assert fake.state()["services"]["haru-cloud-b"]["probes"][-1] == ["/ready", False]
    again = await serve.up(layout.fleet, b)
    assert again.found is True
    assert [c for c in fake.commands() if c == "serve up"] == ["serve up"]
    assert await serve.down("haru-cloud-b") is True
    assert await serve.status("haru-cloud-b") is None
    assert await serve.down("haru-cloud-b") is False


@pytest.mark.timeout(60)
async def test_skyserve_up_that_hangs_is_killed(layout, fake):
    fake.script(serve_script=["hang"])
    b = with_provision(layout.domains[1].spec, launch_timeout_s=1)
    serve = SkyServe(SubprocessExec(kill_grace_s=1), sky=str(fake.path), environ=ENV)
    with pytest.raises(SkyTimeout):
        await serve.up(layout.fleet, b)
    pid = fake.hang_pid()
    assert pid is not None and not pid_alive(pid)


def test_the_cli_dry_run_prints_what_it_would_submit_and_submits_nothing(fake):
    from haru.cli.common import ExitStatus
    from tests.support import haru

    env = {"HARU_SKY": str(fake.path)}
    out = haru("provision", "a", "--dry-run", "--layout", str(EXAMPLE), env=env, check=True)
    head, _, body = out.stdout.partition("\n")
    assert (
        head == "# sky launch --yes --detach-run --cluster haru-cloud-a --secret HARU_AGENT_NATS_CREDS "
        "--secret HARU_SERVING_TOKEN --secret HF_TOKEN <this file>"
    )
    assert yaml.safe_load(body)["resources"]["region"] == "us-east-1"
    out = haru("provision", "b", "--dry-run", "--layout", str(EXAMPLE), "--json", env=env, check=True)
    assert yaml.safe_load(json.loads(out.stdout)["submit"].partition("\n")[2])["service"]["replicas"] == 1
    out = haru("teardown", "a", "--dry-run", "--layout", str(EXAMPLE), env=env, check=True)
    assert "sky down --yes haru-cloud-a" in out.stdout
    out = haru("replace", "a", "--dry-run", "--layout", str(EXAMPLE), env=env, check=True)
    assert out.stdout.index("sky down") < out.stdout.index("sky launch")
    missing = haru("provision", "zz", "--dry-run", "--layout", str(EXAMPLE), env=env)
    assert missing.returncode == ExitStatus.NOT_FOUND and "declared: a, b" in missing.stderr
    static = haru("provision", "a6000-east", "--dry-run", "--layout", str(EXAMPLE.parent / "hearth.json"), env=env)
    assert static.returncode == ExitStatus.ERROR and "static host" in static.stderr
    assert fake.calls() == []  # nothing ran sky


def test_a_launched_agent_without_a_serving_token_is_refused_before_launch(tmp_path, fake):
    """The launched agent serves on every address, which it refuses to do without HARU_SERVING_TOKEN:
    `haru provision --dry-run` and `haru apply` say so, naming the domain and the fix, before anything runs."""
    from tests.support import haru

    doc = json.loads(EXAMPLE.read_text())
    doc["domains"][1]["provision"]["secrets"].remove("HARU_SERVING_TOKEN")
    bad = tmp_path / "cloud-fleet.json"
    bad.write_text(json.dumps(doc))
    env = {"HARU_SKY": str(fake.path)}
    apply = ["apply", "-f", str(bad), "--dry-run", "--nats-url", "nats://127.0.0.1:1"]
    for argv in (["provision", "b", "--dry-run", "--layout", str(bad)], apply):
        out = haru(*argv, env=env)
        assert out.returncode != 0, argv
        assert "domain 'b' launches an agent" in out.stderr and "HARU_SERVING_TOKEN" in out.stderr, out.stderr
        assert 'add "HARU_SERVING_TOKEN" to provision.secrets' in out.stderr
    assert fake.commands() == []  # nothing reached sky
