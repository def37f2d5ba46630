"""`haru up` killed with SIGKILL under load, started again on the same home: nothing acknowledged is
lost, the history verifies, and no process of the first run is left but the runtimes (and serving
port holders) its agents leave by design, which the second run's agents adopt; and a second `haru up`
on a home that a live one holds is refused.

Real processes throughout: `haru up --demo` (embedded nats-server, projector, promoter, gateway, two
agents with simulated runtimes), a load client appending events with expected sequences, `kill -9`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from haru.core import subjects
from haru.core.errors import LogError
from haru.core.events import AgentStopping
from haru.host.children import alive, start_time
from haru.log.eventlog import EventLog
from tests.support import haru
from tests.support.demo import demo_layout_with_free_ports, descendants, launch_up, stop_and_reap, up_argv, wait_ready
from tests.support.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[2]
LOAD_FLEET = "load"
WRITERS = 4


def up_env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HARU_HOME": str(home), "HARU_NO_UVLOOP": "1", **extra}
    for name in ("HARU_NATS_URL", "HARU_API_TOKEN", "HARU_NO_PDEATHSIG"):
        if name not in extra:
            env.pop(name, None)
    return env


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def _outlives_its_agent(pid: int) -> bool:
    """A runtime (the sim vLLM) or a serving port's holder: what an agent leaves running on purpose."""
    line = cmdline(pid)
    return "haru.agents.sim.vllm" in line or "haru.agents.portholder" in line


def stop(proc: subprocess.Popen, tree: set[int]) -> None:
    stop_and_reap(proc, tree)


async def load(nats_url: str, acked: dict[int, tuple[str, bytes]], stop: asyncio.Event) -> None:
    """WRITERS chains of appends, each expecting the last sequence it wrote; every acknowledged
    sequence is recorded with its subject and body. Ends at `stop` or at the first failure (the log
    went away), bounded to 3000 appends a writer."""
    log = await EventLog.open(nats_url, writer="load", timeout=2.0)

    async def writer(i: int) -> None:
        subject = subjects.agent(LOAD_FLEET, f"w{i}")
        expect = 0
        for n in range(3000):
            if stop.is_set():
                return
            event = AgentStopping(at=datetime.now(UTC), by="load", domain=f"w{i}", reason=f"append {n}")
            try:
                expect = await log.append(subject, event, expect=expect)
            except LogError:
                return
            acked[expect] = (subject, f'"append {n}"'.encode())

    try:
        await asyncio.gather(*(writer(i) for i in range(WRITERS)))
    finally:
        try:
            async with asyncio.timeout(5):
                await log.close()
        except (TimeoutError, Exception):  # noqa: BLE001 - the server may be gone
            pass


@pytest.mark.timeout(240)
@pytest.mark.parametrize("death_signal", [True, False], ids=["children-die-with-it", "leftovers-stopped-on-restart"])
async def test_kill_9_under_load_then_restart_loses_nothing_and_leaves_no_orphans(tmp_path, death_signal):
    home = tmp_path / "home"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    first_env = up_env(home, **({} if death_signal else {"HARU_NO_PDEATHSIG": "1"}))
    tree: set[int] = set()
    first, ready = launch_up(tmp_path, layout, first_env, name="first")
    second = None
    try:
        info = await asyncio.to_thread(wait_ready, ready, 90)
        nats_url = info["nats_url"]
        # every agent's runtimes up too: the tree to account for is the whole demo
        await asyncio.to_thread(
            wait_until_sync,
            lambda: len(descendants(first.pid)) >= 2 + 2 + 1 + 6,
            90,
            0.25,
            what="the demo's runtimes",
            retry_on=(Exception,),
        )

        acked: dict[int, tuple[str, bytes]] = {}
        stop_load = asyncio.Event()
        loader = asyncio.create_task(load(nats_url, acked, stop_load))
        await asyncio.sleep(1.5)
        assert acked, "the load client was acknowledged nothing before the crash"
        old = {pid: start_time(pid) for pid in descendants(first.pid)}
        tree |= set(old)

        first.send_signal(signal.SIGKILL)
        first.wait()
        await asyncio.sleep(0.5)
        stop_load.set()
        await asyncio.wait_for(loader, 30)

        survivors = lambda: [p for p, st in old.items() if alive(p, st)]  # noqa: E731
        # The runtimes and the serving ports' holders outlive their agent by design: the second run's
        # agents adopt them. Everything else of the first run must go.
        outliving = lambda: [p for p in survivors() if _outlives_its_agent(p)]  # noqa: E731
        if death_signal:
            # nats-server, projector, promoter and agents get SIGTERM from the kernel; the agents leave
            # their runtimes and port holders, and nothing else is left
            try:
                await asyncio.to_thread(
                    wait_until_sync,
                    lambda: survivors() == outliving() or None,
                    60,
                    0.25,
                    what="every other child to die with haru up",
                    retry_on=(Exception,),
                )
            except AssertionError:
                raise AssertionError(f"still alive: {[(p, cmdline(p)[:120]) for p in survivors()]}") from None
        else:
            assert survivors(), "without the parent-death signal the children should have outlived haru up"

        second, ready2 = launch_up(tmp_path, layout, up_env(home), name="second")
        info2 = await asyncio.to_thread(wait_ready, ready2, 90, "the second haru up to be ready")
        left = [p for p in survivors() if not _outlives_its_agent(p)]
        assert left == [], f"processes of the first run still alive: {[(p, cmdline(p)[:120]) for p in left]}"
        err = (tmp_path / "second.err").read_text()
        if not death_signal:
            assert "up.leftover_stopped" in err and "nats-server" in err, err

        # zero acknowledged events lost: every acked sequence is stored, on its subject, with its body
        async with EventLog.connect([info2["nats_url"]], writer="check") as log:
            stored = {r.seq: r for r in await log.history(subjects.fleet_events(LOAD_FLEET))}
        lost = [
            seq
            for seq, (subject, body) in acked.items()
            if seq not in stored or stored[seq].subject != subject or body not in stored[seq].data
        ]
        assert lost == [], f"{len(lost)} of {len(acked)} acknowledged events lost: {lost[:10]}"
        print(f"{len(acked)} acknowledged appends, all stored after the restart")

        verify = await asyncio.to_thread(haru, "verify", nats_url=info2["nats_url"], env=up_env(home))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "history intact" in verify.stdout
    finally:
        if second is not None:
            stop(second, tree)
        stop(first, tree)


@pytest.mark.timeout(180)
def test_a_second_haru_up_on_the_same_home_is_refused(tmp_path):
    home = tmp_path / "home"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    env = up_env(home)
    tree: set[int] = set()
    first, ready = launch_up(tmp_path, layout, env, name="first")
    try:
        info = wait_ready(ready, 90)
        servers_before = [p for p in descendants(first.pid) if "nats-server" in cmdline(p)]
        again = subprocess.run(
            up_argv(layout),
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
        )
        assert again.returncode == 4, again.stdout + again.stderr  # ExitStatus.CONFLICT
        line = again.stderr.strip()
        assert len(line.splitlines()) == 1, line
        assert "already running" in line and f"pid {first.pid}" in line, line
        assert info["nats_url"] in line and info["gateway_url"] in line, line
        assert f"kill {first.pid}" in line and "--home" in line, line
        # nothing was started by the refused one: still exactly one nats-server, and it is the first's
        every_server = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and "nats-server" in cmdline(int(p.name)) and str(home / "nats") in cmdline(int(p.name))
        ]
        assert every_server == servers_before, (every_server, servers_before)
        # and the first one still serves
        status = haru("status", nats_url=info["nats_url"], env=env)
        assert status.returncode == 0, status.stderr
    finally:
        stop(first, tree)


@pytest.mark.timeout(180)
def test_history_is_read_off_the_disk_of_a_stopped_home_and_the_store_is_left_as_it_was(tmp_path):
    """`haru up` stopped (SIGTERM, or the box turned off): why, as-of, history, verify and status read the
    home's stored log through a private copy, say so, and a later `haru up` finds the store untouched."""
    home = tmp_path / "home"
    layout = demo_layout_with_free_ports(tmp_path / "demo.json")
    env = up_env(home)
    proc, ready = launch_up(tmp_path, layout, env, name="up")
    tree: set[int] = set()
    try:
        wait_ready(ready, 90)

        def b_is_a_standby_asleep() -> bool:
            out = haru("status", "--json", env=env)
            view = json.loads(out.stdout) if out.returncode == 0 else {}
            models = (view.get("domains", {}).get("b") or {}).get("models") or {}
            return bool(models) and all(m.get("residency", {}).get("state") == "sleeping" for m in models.values())

        wait_until_sync(
            b_is_a_standby_asleep, 90, interval_s=1.0, what="b to be a standby, asleep", retry_on=(Exception,)
        )
        promoted = haru("promote", "b", "--wait", env=env, timeout=90)
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        tree |= descendants(proc.pid)
    finally:
        stop(proc, tree)
    store = home / "nats" / "jetstream"
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}

    said = "is not running: reading its stored log"
    status = haru("status", "--json", env=env)
    assert status.returncode == 0 and said in status.stderr, status.stderr
    assert json.loads(status.stdout)["active"] == "b"  # the operator's promotion survived the stop
    verify = haru("verify", env=env)
    assert verify.returncode == 0 and "history intact" in verify.stdout and said in verify.stderr
    why = haru("why", "qwen3-0.6b", "--domain", "a", env=env)
    assert why.returncode == 0 and said in why.stderr, why.stderr
    history = haru("history", "haru.evt.default.route", "--json", env=env)
    assert history.returncode == 0 and "route_moved" in history.stdout
    after = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}
    assert after == before, "the home's own store was written to"

    # A URL the operator names is never second-guessed: nothing listens there, so the usual exit 6.
    named = haru("status", "--nats-url", "nats://127.0.0.1:1", env=env)
    assert named.returncode == 6 and said not in named.stderr
