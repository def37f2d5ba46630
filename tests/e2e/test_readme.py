"""README.md's commands, run as a newcomer runs them, so the README cannot drift from the code.

Every command README shows is accounted for here, or the test fails:

- the two quickstart commands: the test command is the one `.ci/run` runs, character for character, and
  the install-and-run command installs the same way and ends in `haru up --demo`, which the walk-through
  test starts (on free ports and in its own home, so a demo the developer is running is left alone);
- every `$ ` command of the walk-through, in README's order, is run against that demo, verbatim, by
  bash, with `HARU_HOME` pointing at the demo's home (so the CLI finds its NATS as it does after a
  plain `haru up --demo`) and the gateway's `localhost:8700` replaced by the port the demo got. Each
  must exit 0 and print what README shows it printing: the patterns in WALK below must match both
  README's shown output and the real one. A step README says happens by itself "within seconds" is
  polled until it does, within a generous bound;
- every inline command in README's prose (`haru ...`, `curl ...`) is one of the walk's commands or the
  start of one, and every other (`pip ...`, `lint-imports`, `apt-get install ...`) is what `.ci/run` runs.

README itself stays a page a newcomer reads in five minutes: at most 300 lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# the fixture `demo` (tests/e2e/conftest.py): `haru up --demo` in a home of its own, on free ports, stopped
# with its whole tree after the test

pytestmark = pytest.mark.timeout(330)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
MAX_LINES = 300
GATEWAY = "localhost:8700"  # as README writes the gateway; the test's demo listens elsewhere


RUN = r"\d{14}-[0-9a-f]{6}"  # a simulated training run's id: the adapter version it publishes
FINISHED = r"sim trainer of domain b \(pid \d+\) finished run " + RUN
# `haru why <base>:<adapter>`: a publication of version V, and in its subtree (the lines indented under it) the
# decision that promoted V
SERVED_FROM = (
    r'adapter_published +b +\{[^\n]*"version":"(' + RUN + r')"[^\n]*(?:\n  [^\n]*)*?\n  [^\n]*'
    r'"reason":"promoted","version":"\1"'
)


@dataclass(frozen=True)
class Step:
    command: str  # as README shows it after `$ ` (continuation lines joined by one space)
    shows: tuple[str, ...]  # regexes that README's shown output and the real output must both match
    until: bool = False  # README says it happens by itself: poll the command until its output matches


WALK = (
    Step(
        "haru status",
        (
            r"a  ◀ active",
            r"qwen3-0\.6b +asleep",
            r"training lora \(GPU 0\) +running for",
            r"standbys: 1 of 1 fit \(protected\)",
            r"last operation: promotion of a \(op-\w+, initial, .*\): completed",
        ),
        until=True,
    ),
    Step(
        "curl -s localhost:8700/v1/chat/completions -H 'content-type: application/json' "
        """-d '{"model":"qwen3-0.6b","messages":[{"role":"user","content":"hi"}]}'""",
        (r'"content": "\[domain a\] hello from qwen3-0\.6b on the simulated GPU\."',),
    ),
    Step(
        "haru promote b --wait",
        (
            r"requested +manual promotion of b",
            r"stop_training +ok",
            r"wake +ok",
            r"probe +ok",
            r"flip +ok +\d+ ms +route revision \d+: a -> b",
            r"completed +op-",
        ),
    ),
    # the projector publishes the new intent once it folds the flip: under load, a moment after `--wait` returns
    Step("haru route", (r"→ b", r"active +b +http", r"standby +a +http", r"qwen3-0\.6b +ready"), until=True),
    Step("haru why qwen3-0.6b", (r"promotion_requested +b", r'"reason":"manual"', r"waking +b", r"route_moved +b")),
    Step("haru sim detach-gpu b", (r"sim GPU 0 of domain b detached",)),
    Step("haru op", (r"promotion b +manual +completed", r"promotion a +gpu_detached +completed"), until=True),
    Step(
        "haru route",
        (r"→ a", r"standby +b +http\S+ +not eligible: GPU 0 of b detached", r"standbys: none of 1 fit: UNPROTECTED"),
        until=True,
    ),
    Step("haru sim attach-gpu b", (r"sim GPU 0 of domain b attached",)),
    Step(
        "haru status",
        (r"standbys: 1 of 1 fit \(protected\)", r"last operation: demotion of b \(op-\w+, recovered\): completed"),
        until=True,
    ),
    Step("haru verify", (r"verify ok — \d+ events on \d+ subjects, history intact",)),
    # What the standby trains, served. The trainer registers itself a moment after the agent started it (the
    # demotion above, or the one just before): `finish-run` is polled until there is one to finish.
    Step("haru sim finish-run b", (FINISHED + r": adapter qwen3-0\.6b:support, for its agent to publish",), until=True),
    Step(  # published, loaded by a, probed and routed "within seconds"
        "curl -s localhost:8700/v1/chat/completions -H 'content-type: application/json' "
        """-d '{"model":"qwen3-0.6b:support","messages":[{"role":"user","content":"hi"}]}'""",
        (
            r'"model": "qwen3-0\.6b:support@' + RUN,
            r'"content": "\[domain a\] hello from qwen3-0\.6b:support run ' + RUN,
        ),
        until=True,
    ),
    Step("haru demote b --wait", (r"start_training +ok +\d+ ms +lora: started \(pid \d+\)", r"completed +op-")),
    Step("haru sim finish-run b", (FINISHED + r": adapter qwen3-0\.6b:support",), until=True),
    Step("haru demote b --wait", (r"completed +op-",)),
    Step("haru sim finish-run b --diverged", (FINISHED + r", diverged: adapter qwen3-0\.6b:support",), until=True),
    Step(  # the canary holds 10 s before it is promoted, and the diverged version waits for that decision
        "haru why qwen3-0.6b:support",
        (
            # which run the served version came from: under its publication, the canary promoted
            SERVED_FROM,
            r'"canary":"' + RUN + r'","percent":10,"reason":"canary_started"',
            # the diverged version: rolled back by its probe, which says what it answered
            r'"metrics":\{"loss":11\.93',
            r'"reason":"rolled_back","version":"('
            + RUN
            + r')","detail":"version \1 never served: its evaluation probe '
            r"failed on a: prompt 'Where is my order\?' expected 'qwen3-0\.6b:support', answered '\[domain a\] hello "
            r"from the the the the the",
        ),
        until=True,
    ),
)

RUN_COMMAND = "haru up --demo"  # what the quickstart's first command ends in; the demo fixture starts it
# first words of what a reader would type; a code span starting with one of them is a command README shows
COMMAND_WORDS = {"haru", "curl", "pip", "python", "python3", "pytest", "apt-get", "lint-imports", "mypy", "ruff", "."}
COMMAND_WORDS |= {"nats", "kill", "sudo", "docker", "make", "bash", "sh"}


# -- reading README --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    command: str
    output: str


_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def fences(text: str) -> list[tuple[str, str]]:
    """Each fenced block as (its language, its body)."""
    return [(m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(text)]


def console_commands(body: str) -> list[Shown]:
    """The `$ ` commands of a console block, continuation lines (`\\` at the end) joined, each with the
    output README shows under it."""
    shown: list[Shown] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        parts = [lines[i][2:]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            parts[-1] = parts[-1][:-1].rstrip()
            i += 1
            parts.append(lines[i].strip())
        i += 1
        out = []
        while i < len(lines) and not lines[i].startswith("$ "):
            out.append(lines[i])
            i += 1
        shown.append(Shown(" ".join(parts), "\n".join(out)))
    return shown


def prose_commands(text: str) -> list[str]:
    """Inline code spans in README's prose that are commands (they start with a command's name)."""
    spans = re.findall(r"`([^`\n]+)`", _FENCE.sub("", text))
    return [s for s in spans if s.split()[0] in COMMAND_WORDS and (s.split()[0] != "." or s.startswith(". "))]


def ci_test_command(ci: str) -> str:
    """The last command `.ci/run` runs: the README's test command."""
    return [line for line in ci.splitlines() if line.strip() and not line.startswith("#")][-1].strip()


def ci_apt_packages(ci: str) -> set[str]:
    """The packages `.ci/run` installs with apt-get, directly or through its `missing+=(...)` list."""
    pkgs = set(re.findall(r"missing\+=\((\S+)\)", ci))
    for line in re.findall(r"apt-get install ([^\n]+)", ci):
        pkgs |= {w for w in line.split() if not w.startswith("-") and not w.startswith('"') and w.isidentifier()}
    return pkgs


def drift(readme: str, ci: str) -> list[str]:
    """What README shows that this test does not run or check, and what it runs that README no longer shows."""
    problems: list[str] = []
    lines = readme.count("\n") + 1
    if lines > MAX_LINES:
        problems.append(f"README.md is {lines} lines: keep it under {MAX_LINES} and move the rest into docs/")

    blocks = fences(readme)
    for lang, body in blocks:
        if lang not in ("sh", "console"):
            problems.append(f"README shows a ```{lang} block that no test runs: move it to docs/ ({body[:60]!r})")

    sh = [body.strip() for lang, body in blocks if lang == "sh"]
    test_command = ci_test_command(ci)
    if len(sh) != 2:
        problems.append(f"the quickstart has {len(sh)} ```sh commands; it has exactly two: install and run, and test")
    else:
        run, test = sh
        if test != test_command:
            problems.append(f"README's test command {test!r} is not the one .ci/run runs: {test_command!r}")
        if not run.endswith(" && " + RUN_COMMAND):
            problems.append(f"README's first command {run!r} does not end in {RUN_COMMAND!r}, which this test runs")
        if run.split(" && ")[:2] != test_command.split(" && ")[:2]:
            problems.append(f"README's first command {run!r} does not make its venv as the test command does")

    shown = [s for lang, body in blocks if lang == "console" for s in console_commands(body)]
    if [s.command for s in shown] != [s.command for s in WALK]:
        problems.append(
            "README's walk-through is not what this test runs; README:\n  "
            + "\n  ".join(s.command for s in shown)
            + "\nthis test (WALK):\n  "
            + "\n  ".join(s.command for s in WALK)
        )
    else:
        for readme_step, step in zip(shown, WALK, strict=True):
            for pattern in step.shows:
                if not re.search(pattern, readme_step.output):
                    problems.append(f"README does not show what `{step.command}` is checked to print: /{pattern}/")

    walked = [s.command.split() for s in WALK] + [RUN_COMMAND.split()]
    for span in prose_commands(readme):
        words = span.split()
        if words[0] in ("haru", "curl"):
            if not any(w[: len(words)] == words for w in walked):
                problems.append(f"README's prose names `{span}`, which this test does not run")
        elif words[0] == "apt-get":
            missing = {w for w in words[2:]} - ci_apt_packages(ci)
            if words[1] != "install" or missing:
                problems.append(f"README's prose says `{span}`, but .ci/run installs {sorted(ci_apt_packages(ci))}")
        elif span not in ci:
            problems.append(f"README's prose names `{span}`, which neither this test nor .ci/run runs")
    return problems


# -- the checks ------------------------------------------------------------------------------------


def test_readme_shows_what_this_test_runs():
    problems = drift(README.read_text(), CI.read_text())
    assert not problems, "\n".join(problems)


def test_drift_is_found():
    """The checker fails a README that gained a command, lost one, changed its test command or grew long."""
    readme, ci = README.read_text(), CI.read_text()
    assert drift(readme, ci) == []
    added = readme.replace("$ haru verify\n", "$ haru history\n$ haru verify\n")
    assert any("walk-through is not what this test runs" in p for p in drift(added, ci))
    shown_less = readme.replace("sim GPU 0 of domain b detached\n", "")
    assert any("/sim GPU 0 of domain b detached/" in p for p in drift(shown_less, ci))
    assert any("not the one .ci/run runs" in p for p in drift(readme, ci.replace("&& pytest\n", "&& pytest -x\n")))
    assert any("which this test does not run" in p for p in drift(readme + "\nTry `haru serve`.\n", ci))
    assert any("neither this test nor .ci/run" in p for p in drift(readme + "\nThen `nats stream ls`.\n", ci))
    assert any("```python block" in p for p in drift(readme + "\n```python\nprint(1)\n```\n", ci))
    assert any("lines: keep it under" in p for p in drift(readme + "\n" * MAX_LINES, ci))


def run_step(step: Step, gateway: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = step.command.replace(GATEWAY, gateway)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_readme_walkthrough_runs(demo):  # noqa: F811 - the demo fixture, imported
    assert shutil.which("curl"), "README's walk-through chats with curl: install curl (apt-get install curl)"
    env = {
        **demo["env"],
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # `haru` as installed
    }
    for name in ("HARU_NATS_URL", "HARU_DEFAULT_FLEET", "HARU_GATEWAY_URL", "HARU_API_TOKEN"):
        env.pop(name, None)
    gateway = demo["gateway_url"].removeprefix("http://")
    for step in WALK:
        deadline = time.monotonic() + (90 if step.until else 0)
        while True:
            proc = run_step(step, gateway, env)
            missing = [p for p in step.shows if not re.search(p, proc.stdout)]
            if proc.returncode == 0 and not missing:
                break
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"`{step.command}` exited {proc.returncode}, its output missing {missing}:\n"
                    f"{proc.stdout}\n{proc.stderr}"
                )
            time.sleep(1)
