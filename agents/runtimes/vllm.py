"""vLLM: its command line the plan's (`haru.core.launch`), in the form its `binary` names: `vllm serve
<source> ...` or `<python> -m vllm.entrypoints.openai.api_server --model <source> ...`, with
`--host 127.0.0.1 --port P --served-model-name NAME --gpu-memory-utilization F --max-model-len N`
(F is the model's planned VRAM over the GPU's memory, rounded down) and, when that vLLM can sleep,
`--enable-sleep-mode`.

Whether it can sleep is learned, not assumed (`sleep_mode`), first answer wins:
1. the managed vLLM (`agents.runtimes.vllm_env`) asked its platform when it was installed;
2. what this agent learned of the same binary before (`vllm-abilities.json` in the runtime log dir);
3. an interpreter named by the binary (the api_server form) is asked, once: vLLM's own
   `current_platform.is_sleep_mode_available()`;
4. otherwise it is launched with the flag, and a refusal at start (`Sleep mode is not supported on
   current platform`, exit 1) is learned: the next launch goes without it.
A vLLM that cannot sleep is treated like llama-server: `can_sleep` is false, a standby keeps it
resident. It still gets VLLM_SERVER_DEV_MODE=1, so `/is_sleeping` tells a paused engine (one that
took `POST /sleep` without sleep mode: it frees nothing and holds every request until `/wake_up`)
from a serving one: the probe asks it before sending any completion.

`POST /sleep?level=1` and `POST /wake_up` answer a bare 200 that proves nothing: both are checked
against `GET /is_sleeping`; what a sleep freed is the supervisor's to measure. A wake that fails
because someone else holds the VRAM answers 500 "CUDA Error: out of memory": `OutOfMemory`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import msgspec

from haru.agents.errors import RuntimeRefused, Unverified
from haru.agents.runtimes.base import ProcessRuntime
from haru.core.launch import API_SERVER_MODULE, Launch, vllm_form

SLEEP_REFUSAL = "Sleep mode is not supported on current platform"
ABILITIES_FILE = "vllm-abilities.json"
ASK_TIMEOUT_S = 120.0  # importing vLLM to ask it: ~8 s on 2 quiet cores


class VllmRuntime(ProcessRuntime):
    kind = "vllm"
    can_sleep = True  # vLLM's sleep mode, until this one is found not to have it (an instance's own bit)
    default_binary = ["vllm"]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.can_sleep = True
        self.sleep_mode = ""  # "on: <how it was learned>" / "off: <why>"; "" until the first start decides
        self.platform = ""  # vLLM's platform where known ("cpu", "cuda", ...)
        self._decided = False

    # -- which binary, and whether it can sleep
    def managed_binary(self) -> list[str]:
        """A layout naming no binary gets the managed vLLM ($HARU_VLLM_PYTHON or the cached venv) when
        there is one, else `vllm` from PATH (the plan's default)."""
        from haru.agents.runtimes.vllm_env import BuildError, find_python, launch_binary

        try:
            found = find_python()
        except BuildError:
            return []
        return launch_binary(found) if found is not None else []

    def _binary(self) -> list[str]:
        return list(self.spec.binary) or self.managed_binary() or list(self.default_binary)

    def _abilities_path(self) -> Path:
        return self._log_dir / ABILITIES_FILE

    def _remembered(self, key: str) -> dict | None:
        try:
            entry = json.loads(self._abilities_path().read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            return None
        return entry if isinstance(entry, dict) and isinstance(entry.get("sleep_mode"), bool) else None

    def _remember(self, key: str, sleep_mode: bool, how: str, platform: str = "") -> None:
        path = self._abilities_path()
        try:
            known = json.loads(path.read_text())
            if not isinstance(known, dict):
                known = {}
        except (OSError, ValueError):
            known = {}
        known[key] = {"sleep_mode": sleep_mode, "how": how, "platform": platform or self.platform}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)

    def _set(self, can: bool, how: str, platform: str = "") -> None:
        self.platform = platform or self.platform
        self.can_sleep = can
        self.sleep_mode = f"{'on' if can else 'off'}: {how}"
        self._decided = True

    def _known(self) -> bool:
        """Steps 1 and 2 (no process started): True if that decided it."""
        if self._decided:
            return True
        binary = self._binary()
        from haru.agents.runtimes.vllm_env import BuildError, abilities, find_python, launch_binary

        managed = abilities()
        try:
            python = find_python()
        except BuildError:  # a bad HARU_VLLM_PYTHON: the binary the layout names is asked instead
            python = None
        if managed is not None and python is not None and binary == launch_binary(python):
            self._set(
                bool(managed["sleep_mode"]),
                f"the managed vLLM {managed['version']} on {managed['platform']} said so when it was installed",
                str(managed["platform"] or ""),
            )
            return True
        remembered = self._remembered(" ".join(binary))
        if remembered is not None:
            self._set(
                remembered["sleep_mode"],
                str(remembered.get("how", "learned before")),
                str(remembered.get("platform") or ""),
            )
            return True
        return False

    async def learn_abilities(self) -> str:
        """Decide, before a start, whether this vLLM can sleep (see the module docstring); the answer,
        as recorded with the launch ("on: ..." / "off: ...")."""
        if self._known():
            return self.sleep_mode
        binary = self._binary()
        if vllm_form(binary) == "api_server" and binary[-1] == API_SERVER_MODULE:
            said = await _ask(binary[0])
            if said is not None:
                how = f"vLLM {said.get('version')} on {said.get('platform')} said so (is_sleep_mode_available)"
                self._remember(" ".join(binary), bool(said.get("sleep_mode")), how, str(said.get("platform") or ""))
                self._set(bool(said.get("sleep_mode")), how, str(said.get("platform") or ""))
                return self.sleep_mode
        self.can_sleep = True
        self.sleep_mode = "on: assumed until this vLLM says otherwise"
        return self.sleep_mode

    def never_sleeps(self, how: str) -> None:
        """What the supervisor learned (a sleep that freed nothing): this vLLM is not put to sleep again."""
        self._remember(" ".join(self._binary()), False, how)
        self._set(False, how)

    def learn_from_exit(self, output: str) -> str:
        """A start refused because of sleep mode is learned: the next launch goes without the flag.
        Returns what was learned ("" if nothing)."""
        attempt = output.rsplit("--- haru agent starting:", 1)[-1]
        if SLEEP_REFUSAL not in attempt or not self.can_sleep:
            return ""
        how = f"it refused --enable-sleep-mode at start ({SLEEP_REFUSAL})"
        self._remember(" ".join(self._binary()), False, how)
        self._set(False, how)
        return f"sleep mode is off for this vLLM from now on: {how}"

    def launch(self) -> Launch:
        self._known()
        return self._launch(sleep_mode=self.can_sleep, platform=self.platform)

    def adopt(self, pid: int, start: int, port: int, argv: list[str]) -> bool:
        """A runtime a previous agent started can sleep if it was launched able to."""
        taken = super().adopt(pid, start, port, argv)
        if taken:
            self._set("--enable-sleep-mode" in argv, "as launched by the previous agent")
        return taken

    async def start(self) -> None:
        if not self.alive():
            await self.learn_abilities()
        await super().start()

    # -- sleep and wake, verified by /is_sleeping
    async def is_sleeping(self, timeout_s: float = 5.0) -> bool | None:
        """Asked even of a vLLM that cannot sleep: it may still have been paused (`POST /sleep` without
        sleep mode), and a paused engine holds every request sent to it."""
        status, body = await self._request("GET", "/is_sleeping", timeout_s=timeout_s)
        if status != 200:
            raise RuntimeRefused(f"{self.spec.name}: /is_sleeping answered {status}", status=status)
        try:
            return msgspec.json.decode(body, type=_Sleeping).is_sleeping
        except msgspec.DecodeError as exc:
            raise RuntimeRefused(f"{self.spec.name}: /is_sleeping said {body[:100]!r}", status=status) from exc

    async def sleep(self, level: int, timeout_s: float) -> None:
        if not self.can_sleep:
            raise RuntimeRefused(f"{self.spec.name}: this vLLM cannot sleep ({self.sleep_mode}); it stays resident")
        status, body = await self._request("POST", f"/sleep?level={int(level)}", timeout_s=timeout_s)
        if status != 200:
            self._raise_for(self.spec.name, f"POST /sleep?level={level}", status, body)
        if await self.is_sleeping() is not True:
            raise Unverified(f"{self.spec.name}: /sleep answered 200 but /is_sleeping says it is awake")

    async def wake(self, timeout_s: float) -> None:
        status, body = await self._request("POST", "/wake_up", timeout_s=timeout_s)
        if status != 200:
            self._raise_for(self.spec.name, "POST /wake_up", status, body)
        if await self.is_sleeping() is not False:
            raise Unverified(f"{self.spec.name}: /wake_up answered 200 but /is_sleeping says it still sleeps")


class _Sleeping(msgspec.Struct):
    is_sleeping: bool


async def _ask(python: str) -> dict | None:
    """vLLM's own answer, from that interpreter: {"version", "platform", "sleep_mode"} (None: no answer)."""
    from haru.agents.runtimes.vllm_env import ABILITIES_SNIPPET

    try:
        proc = await asyncio.create_subprocess_exec(
            python,
            "-c",
            ABILITIES_SNIPPET,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return None
    try:
        async with asyncio.timeout(ASK_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    try:
        said = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return said if isinstance(said, dict) and "sleep_mode" in said else None
