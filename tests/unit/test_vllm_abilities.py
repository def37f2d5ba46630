"""Whether a vLLM can sleep is learned (the managed env's stamp, vLLM asked through its interpreter, its
refusal at start), and what a sleep freed is measured, never assumed."""

from __future__ import annotations

import json
import os
import stat

import aiohttp
import pytest

from haru.agents.gpu import GpuReading
from haru.agents.runtimes.vllm import SLEEP_REFUSAL, VllmRuntime
from haru.agents.runtimes.vllm_env import API_SERVER, PACKAGE, STAMP, VERSION
from haru.agents.sleep_wake import freed_by_sleep
from haru.core.events import GpuProcess
from haru.core.specs import GiB, ModelSpec


def spec(binary: list[str]) -> ModelSpec:
    return ModelSpec(
        name="tiny", slot="chat", gpu_index=0, runtime="vllm", source="/m/tiny", vram_bytes=3 * GiB, binary=binary
    )


@pytest.fixture
def no_managed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HARU_VLLM_PYTHON", raising=False)


async def test_a_refusal_of_sleep_mode_at_start_is_learned_and_remembered(tmp_path, no_managed):
    async with aiohttp.ClientSession() as s:
        rt = VllmRuntime(spec(["/opt/vllm/bin/vllm"]), session=s, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
        assert await rt.learn_abilities() == "on: assumed until this vLLM says otherwise"
        assert "--enable-sleep-mode" in rt.launch().argv
        output = (
            "--- haru agent starting: vllm serve ...\n"
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
            f"  Value error, {SLEEP_REFUSAL}. [type=value_error]\n"
        )
        learned = rt.learn_from_exit(output)
        assert "sleep mode is off" in learned and SLEEP_REFUSAL in learned
        assert rt.can_sleep is False and "--enable-sleep-mode" not in rt.launch().argv
        assert rt.launch().env["VLLM_SERVER_DEV_MODE"] == "1"
        assert rt.learn_from_exit(output) == ""  # learned once
        # The next agent (a new runtime object, the same log dir) knows it before starting anything.
        later = VllmRuntime(spec(["/opt/vllm/bin/vllm"]), session=s, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
        assert (await later.learn_abilities()).startswith("off: it refused --enable-sleep-mode")
        assert "--enable-sleep-mode" not in later.launch().argv
        # Another binary is another vLLM: not concluded from this one.
        other = VllmRuntime(spec(["/srv/gpu/bin/vllm"]), session=s, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
        assert (await other.learn_abilities()).startswith("on:")


async def test_an_interpreter_named_by_the_binary_is_asked(tmp_path, no_managed):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"version": "0.9.9", "platform": "cuda", "sleep_mode": true}\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    async with aiohttp.ClientSession() as s:
        rt = VllmRuntime(spec([str(fake), "-m", API_SERVER]), session=s, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
        said = await rt.learn_abilities()
        assert said == "on: vLLM 0.9.9 on cuda said so (is_sleep_mode_available)"
        assert rt.launch().argv[:5] == [str(fake), "-m", API_SERVER, "--model", "/m/tiny"]
        assert "--enable-sleep-mode" in rt.launch().argv and "VLLM_CPU_KVCACHE_SPACE" not in rt.launch().env
        assert (
            json.loads((tmp_path / "vllm-abilities.json").read_text())[f"{fake} -m {API_SERVER}"]["sleep_mode"] is True
        )


async def test_the_managed_vllm_says_what_it_is_and_a_layout_without_binary_gets_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HARU_VLLM_PYTHON", raising=False)
    venv = tmp_path / "cache" / "haru" / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / STAMP).write_text(
        json.dumps(
            {"package": PACKAGE, "version": VERSION, "vllm_version": VERSION, "platform": "cpu", "sleep_mode": False}
        )
    )
    async with aiohttp.ClientSession() as s:
        rt = VllmRuntime(spec([]), session=s, log_dir=tmp_path, gpu_memory_bytes=24 * GiB)
        assert (await rt.learn_abilities()).startswith(f"off: the managed vLLM {VERSION} on cpu")
        planned = rt.launch()
        assert planned.argv[:5] == [str(venv / "bin" / "python"), "-m", API_SERVER, "--model", "/m/tiny"]
        assert "--enable-sleep-mode" not in planned.argv
        assert planned.env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the plan's 3 GiB, on the CPU platform
    os.unlink(venv / STAMP)  # an unfinished install is not used
    async with aiohttp.ClientSession() as s:
        rt = VllmRuntime(spec([]), session=s, log_dir=tmp_path / "x", gpu_memory_bytes=24 * GiB)
        assert rt.launch().argv[:3] == ["vllm", "serve", "/m/tiny"]


def reading(used: int, processes: dict[int, int], *, present: bool | None = True, accounted: bool = True) -> GpuReading:
    return GpuReading(
        index=0,
        present=present,
        memory_total_bytes=24 * GiB,
        memory_used_bytes=used,
        processes=[GpuProcess(pid=p, used_bytes=n) for p, n in processes.items()],
        accounted=accounted,
    )


def test_what_a_sleep_freed_is_the_runtimes_own_processes_when_nvml_tells_them_apart():
    tree = frozenset({100, 101})  # the API server and its engine process
    before = reading(20 * GiB, {101: 9 * GiB, 555: 8 * GiB})
    after = reading(19 * GiB, {101: 1 * GiB, 555: 10 * GiB})  # a trainer grew meanwhile
    assert freed_by_sleep(before, after, tree)[:2] == (8 * GiB, "process")
    # A paused engine: the same bytes held after.
    assert freed_by_sleep(before, reading(20 * GiB, {101: 9 * GiB, 555: 8 * GiB}), tree)[:2] == (0, "process")


def test_without_per_process_figures_the_gpu_measures_and_without_a_gpu_reading_nothing_does():
    tree = frozenset({100})
    freed, by, _ = freed_by_sleep(reading(20 * GiB, {}, accounted=False), reading(12 * GiB, {}, accounted=False), tree)
    assert (freed, by) == (8 * GiB, "gpu")
    freed, by, detail = freed_by_sleep(reading(0, {}, present=None), reading(0, {}, present=None), tree)
    assert (freed, by) == (0, "") and "not measured" in detail


def test_what_vllm_said_is_its_exception_not_the_log_lines_that_mention_paths():
    from haru.agents.runtime_said import runtime_said

    output = "\n".join(
        [
            "--- haru agent starting: python -m vllm.entrypoints.openai.api_server --model /srv/cannot-load/m",
            "(APIServer pid=1) INFO 12-01 21:49:49 [api_utils.py:347]   model   /srv/cannot-load/m",
            "(APIServer pid=1) WARNING 12-01 21:49:49 [system_utils.py:255] failed to automatically increase ulimit",
            "Traceback (most recent call last):",
            '  File "/venv/vllm/engine/arg_utils.py", line 1955, in create_model_config',
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
            "  Value error, Model architectures ['NoSuchForCausalLM'] are not supported for now. Supported "
            "architectures: dict_keys([" + ", ".join(f"'Arch{i}ForCausalLM'" for i in range(400)) + "])",
            "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
        ]
    )
    said = runtime_said(output, 1)
    assert said.startswith(
        "exited with code 1 while loading: pydantic_core._pydantic_core.ValidationError: 1 "
        "validation error for ModelConfig | Value error, Model architectures ['NoSuchForCausalLM'] "
        "are not supported for now."
    ), said
    assert "cannot-load" not in said and len(said) <= 1000


def test_the_managed_env_is_used_only_when_its_stamp_names_the_pin(tmp_path, monkeypatch):
    from haru.agents.runtimes.vllm_env import BuildError, ensure_env, find_python

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HARU_VLLM_PYTHON", raising=False)
    venv = tmp_path / "haru" / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert find_python() is None  # no stamp: an install that did not finish
    (venv / STAMP).write_text(json.dumps({"package": PACKAGE, "version": "0.0.1", "sleep_mode": False}))
    assert find_python() is None  # made from another pin
    with pytest.raises(BuildError, match="python -m haru.agents.runtimes.vllm_env"):
        ensure_env(build=False)
    (venv / STAMP).write_text(json.dumps({"package": PACKAGE, "version": VERSION, "sleep_mode": False}))
    assert find_python() == venv / "bin" / "python"
    monkeypatch.setenv("HARU_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(BuildError, match="HARU_VLLM_PYTHON"):
        find_python()
