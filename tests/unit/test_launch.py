"""The plan becomes each runtime's command line (haru.core.launch): exact argv and env for every shipped layout,
the refusals of operator args that contradict the plan, and the runtime that follows the model's format."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from haru.agents.config import slots_from_host_entry
from haru.core.errors import LayoutError
from haru.core.launch import Launch, gpu_memory_utilization, launch, runtime_for, source_format
from haru.core.layout import load_layout, parse_layout
from haru.core.sizes import GiB
from haru.core.specs import Layout, ModelSpec

ROOT = Path(__file__).resolve().parents[2]
SIM = ["python", "-m", "haru.agents.sim.vllm"]
PLANNED_ENV = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
VLLM_ENV = {**PLANNED_ENV, "VLLM_SERVER_DEV_MODE": "1"}


def launches(layout: Layout) -> dict[tuple[str, str], Launch]:
    """Every launched model of a layout, as the agent would start it (port from the layout, no agent env)."""
    out = {}
    for d in layout.domains:
        memory = {g.index: g.memory_bytes for g in d.spec.gpus}
        for m in d.models:
            out[(d.spec.name, m.name)] = launch(m, gpu_memory_bytes=memory[m.gpu_index], port=m.port, base_env={})
    return out


def vllm(binary, source, port, name, util, max_len=None):
    argv = [
        *binary,
        "serve",
        source,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--gpu-memory-utilization",
        util,
    ]
    if max_len:
        argv += ["--max-model-len", str(max_len)]
    return argv + ["--enable-sleep-mode"]


def test_demo_fleet_argv_and_env_are_pinned():
    got = launches(load_layout(ROOT / "deploy/examples/demo-fleet.json"))
    for domain, base in (("a", 18610), ("b", 18620)):
        # 24 GiB simulated GPU: 2/24 = 0.0833 -> 0.083, 9/24 = 0.375, 10/24 = 0.4166 -> 0.416
        lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]  # adapters loaded at run time
        assert got[(domain, "qwen3-0.6b")] == Launch(
            argv=vllm(SIM, "Qwen/Qwen3-0.6B", base + 1, "qwen3-0.6b", "0.083", 8192)[:-1]
            + lora
            + ["--enable-sleep-mode"],
            env={**VLLM_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HARU_SIM_VRAM": "2GiB"},
        )  # the shipped file gives the simulator its model's VRAM (HARU_SIM_VRAM) in the model's env
        assert got[(domain, "Qwen/Qwen3-4B-Instruct")] == Launch(
            argv=vllm(SIM, "Qwen/Qwen3-4B-Instruct", base + 2, "Qwen/Qwen3-4B-Instruct", "0.375", 16384),
            env={**VLLM_ENV, "HARU_SIM_VRAM": "9GiB"},
        )
        assert got[(domain, "qwen3.6:27b-sim")] == Launch(
            argv=vllm(SIM, "Qwen/Qwen3-27B", base + 3, "qwen3.6:27b-sim", "0.416", 16384),
            env={**VLLM_ENV, "HARU_SIM_VRAM": "10GiB"},
        )
    assert len(got) == 6


def test_hearth_argv_and_env_are_pinned():
    got = launches(load_layout(ROOT / "deploy/examples/hearth.json"))
    for domain in ("a6000-east", "a6000-west"):
        assert got[(domain, "muse-local:latest")] == Launch(
            argv=[
                "llama-server",
                "-m",
                "/models/muse.gguf",
                "--host",
                "127.0.0.1",
                "--port",
                "18080",
                "--alias",
                "muse-local:latest",
                "-c",
                "16384",
                "-ngl",
                "999",
            ],
            env=PLANNED_ENV,
        )
        # 48 GiB A6000: 22/48 = 0.4583 -> 0.458, 17/48 = 0.3541 -> 0.354, 18/48 = 0.375, 20/48 = 0.4166 -> 0.416
        v = ["vllm"]
        assert got[(domain, "deepseek-r1:32b")] == Launch(
            argv=vllm(v, "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 18081, "deepseek-r1:32b", "0.458"), env=VLLM_ENV
        )
        assert got[(domain, "gemma4:26b")] == Launch(
            argv=vllm(v, "google/gemma-4-26b-it", 18082, "gemma4:26b", "0.354"), env=VLLM_ENV
        )
        assert got[(domain, "qwen3.6:27b")] == Launch(
            argv=vllm(v, "Qwen/Qwen3.6-27B", 18083, "qwen3.6:27b", "0.375"), env=VLLM_ENV
        )
        assert got[(domain, "gemma4-extract:31b")] == Launch(
            argv=vllm(v, "google/gemma-4-31b-it", 18084, "gemma4-extract:31b", "0.416"), env=VLLM_ENV
        )
    assert len(got) == 10


def test_agent_host_entries_argv_and_env_are_pinned():
    doc = json.loads((ROOT / "deploy/agents/llama-server-host.json").read_text())
    slots = slots_from_host_entry(doc["fleet"], doc["domain"], doc["host"], doc["policy"])
    got = launches(Layout(fleet=slots.fleet, domains=[slots.domain]))
    binary = ["/usr/local/bin/llama-server"]
    assert got[("box-1", "qwen3-8b:q4_k_m")] == Launch(
        argv=[
            *binary,
            "-m",
            "/srv/models/Qwen3-8B-Q4_K_M.gguf",
            "--host",
            "127.0.0.1",
            "--port",
            "18080",
            "--alias",
            "qwen3-8b:q4_k_m",
            "-c",
            "16384",
            "-ngl",
            "999",
            "--parallel",
            "4",
        ],
        env=PLANNED_ENV,
    )
    assert got[("box-1", "nomic-embed-text:v1.5")] == Launch(
        argv=[
            *binary,
            "-m",
            "/srv/models/nomic-embed-text-v1.5.f16.gguf",
            "--host",
            "127.0.0.1",
            "--port",
            "18081",
            "--alias",
            "nomic-embed-text:v1.5",
            "-c",
            "8192",
            "-ngl",
            "999",
            "--embeddings",
        ],
        env=PLANNED_ENV,
    )
    # vllm-host.json declares no host entry: its models come from the fleet's declarations (hearth's, above)
    assert "host" not in json.loads((ROOT / "deploy/agents/vllm-host.json").read_text())


def test_adapters_offload_device_and_env():
    spec = ModelSpec(
        name="base",
        slot="s",
        gpu_index=2,
        vram_bytes=10 * GiB,
        source="/srv/m",
        context_length=4096,
        adapters={"sql": "/srv/loras/sql", "chat": "/srv/loras/chat"},
        env={"X": "1"},
    )
    got = launch(spec, gpu_memory_bytes=80 * GiB, port=9000, bind_host="10.0.0.5", base_env={"PATH": "/bin"})
    assert got.argv == [
        "vllm",
        "serve",
        "/srv/m",
        "--host",
        "10.0.0.5",
        "--port",
        "9000",
        "--served-model-name",
        "base",
        "--gpu-memory-utilization",
        "0.125",
        "--max-model-len",
        "4096",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        "sql=/srv/loras/sql",
        "chat=/srv/loras/chat",
        "--enable-sleep-mode",
    ]
    assert got.env == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "VLLM_SERVER_DEV_MODE": "1",
        "X": "1",
    }
    llama = msgspec.structs.replace(
        spec, runtime="llama_server", source="/m.gguf", gpu_layers=20, adapters={"a": "/a.gguf"}, context_length=0
    )
    assert launch(llama, gpu_memory_bytes=0, port=9001, base_env={}).argv == [
        "llama-server",
        "-m",
        "/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--alias",
        "base",
        "-ngl",
        "20",
        "--lora",
        "/a.gguf",
    ]


def test_a_smaller_utilization_replaces_the_planned_one_and_equal_copies_are_dropped():
    spec = ModelSpec(
        name="m",
        slot="s",
        gpu_index=0,
        vram_bytes=12 * GiB,
        source="Qwen/x",
        context_length=2048,
        args=["--max-model-len=2048", "--gpu-memory-utilization", "0.3", "--enable-sleep-mode", "--seed", "1"],
    )
    argv = launch(spec, gpu_memory_bytes=24 * GiB, port=1, base_env={}).argv
    assert argv.count("--gpu-memory-utilization") == 1 and argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
    assert argv.count("--max-model-len") == 1 and "--max-model-len=2048" not in argv
    assert argv.count("--enable-sleep-mode") == 1 and argv[-2:] == ["--seed", "1"]


@given(vram=st.integers(1, 200 * GiB), memory=st.integers(1 * GiB, 200 * GiB))
def test_the_fraction_never_exceeds_the_plan(vram, memory):
    fraction = gpu_memory_utilization(vram, memory)
    assert len(fraction.split(".")[1]) == 3
    thousandths = int(fraction.replace(".", ""))
    assert thousandths * memory <= vram * 1000  # fraction x memory <= vram, exactly
    assert (thousandths + 1) * memory > vram * 1000  # and it is the largest such fraction at this precision


# ------------------------------------------------------------------------------- refusals at apply


def layout(model: dict, memory: str = "24GiB") -> dict:
    def dom(name: str) -> dict:
        return {
            "name": name,
            "gpus": [{"index": 0, "memory": memory}],
            "slots": [{"name": "chat", "gpu": 0, "models": [copy.deepcopy(model)]}],
        }

    return {"fleet": "f", "domains": [dom("a"), dom("b")]}


def refusal(model: dict) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        parse_layout(layout(model))
    return info.value


VLLM = {"name": "m", "vram": "12GiB", "source": "Qwen/x", "context_length": 4096}
LLAMA = {"name": "m", "vram": "4GiB", "source": "/m.gguf", "context_length": 4096}


@pytest.mark.parametrize(
    "model, index, words",
    [
        (
            {**VLLM, "args": ["--gpu-memory-utilization", "0.9"]},
            0,
            ["--gpu-memory-utilization 0.9", "0.500", "12.0 GiB of the 24.0 GiB"],
        ),
        (
            {**VLLM, "args": ["--seed", "1", "--gpu-memory-utilization=0.95"]},
            2,
            ["--gpu-memory-utilization 0.95", "0.500"],
        ),
        ({**VLLM, "args": ["--max-model-len", "8192"]}, 0, ["--max-model-len 8192", "4096", "context_length"]),
        (
            {**VLLM, "context_length": 0, "args": ["--max-model-len=8192"]},
            0,
            ["--max-model-len 8192", "unset context_length"],
        ),
        ({**VLLM, "args": ["--port", "9999"]}, 0, ["--port 9999", "the agent sets it"]),
        ({**VLLM, "args": ["--host=0.0.0.0"]}, 0, ["--host 0.0.0.0"]),
        (
            {**VLLM, "args": ["--served-model-name", "other"]},
            0,
            ["--served-model-name other", "m (from the model's name)"],
        ),
        ({**LLAMA, "args": ["-c", "8192"]}, 0, ["-c 8192", "4096"]),
        ({**LLAMA, "args": ["--ctx-size=2048"]}, 0, ["--ctx-size 2048", "4096"]),
        ({**LLAMA, "args": ["--alias", "x"]}, 0, ["--alias x", "m (from the model's name)"]),
        ({**LLAMA, "args": ["-a", "x"]}, 0, ["-a x"]),
        ({**LLAMA, "args": ["-ngl", "10"]}, 0, ["-ngl 10", "999 (from the model's gpu_layers)"]),
        ({**LLAMA, "gpu_layers": 20, "args": ["--n-gpu-layers", "999"]}, 0, ["--n-gpu-layers 999", "20"]),
        ({**LLAMA, "args": ["--port", "1", "--port", "2"]}, 0, ["--port 1"]),
        ({**LLAMA, "args": ["-m", "/other.gguf"]}, 0, ["-m /other.gguf", "/m.gguf"]),
        ({**LLAMA, "args": ["-c", "4096", "--ctx-size", "4096"]}, 2, ["--ctx-size 4096", "once"]),
    ],
)
def test_args_that_contradict_the_plan_are_refused_naming_flag_values_and_fix(model, index, words):
    err = refusal(model)
    assert err.path == f"$.domains[0].slots[0].models[0].args[{index}]"
    for w in words:
        assert w in str(err), (w, str(err))
    assert err.fix.startswith(("remove it", "give "))


def test_harmless_extra_flags_and_agreeing_copies_pass():
    parsed = parse_layout(layout({**LLAMA, "args": ["--parallel", "4", "-c", "4096", "-ngl", "999", "--alias=m"]}))
    assert parsed.domains[0].models[0].args == ["--parallel", "4", "-c", "4096", "-ngl", "999", "--alias=m"]
    parse_layout(layout({**VLLM, "args": ["--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.4"]}))


def test_env_cannot_move_the_runtime_off_its_gpu():
    err = refusal({**VLLM, "env": {"CUDA_VISIBLE_DEVICES": "1"}})
    assert err.path.endswith(".env.CUDA_VISIBLE_DEVICES") and "GPU 0" in str(err)
    # a tensor-parallel model spanning GPUs names several, the plan's among them
    tp = parse_layout(layout({**VLLM, "env": {"CUDA_VISIBLE_DEVICES": "0,1"}})).domains[0].models[0]
    assert launch(tp, gpu_memory_bytes=24 * GiB, port=1, base_env={}).env["CUDA_VISIBLE_DEVICES"] == "0,1"


# ----------------------------------------------------------------------------- format -> runtime


@pytest.mark.parametrize(
    "source, fmt, runtime",
    [
        ("/srv/m/qwen-q4.gguf", "gguf", "llama_server"),
        ("~/m.GGUF", "gguf", "llama_server"),
        ("/srv/models/Qwen3-8B", "directory", "vllm"),
        ("./m", "directory", "vllm"),
        ("Qwen/Qwen3-8B", "hf_repo", "vllm"),
        ("gpt2", "hf_repo", "vllm"),
        ("qwen3.6:27b", "unknown", "vllm"),
        # registry references the agent pulls (haru.models): Ollama and a GGUF quantization are GGUF
        ("ollama:qwen3:0.6b", "gguf_ref", "llama_server"),
        ("hf:Qwen/Qwen3-0.6B-GGUF:Q4_K_M", "gguf_ref", "llama_server"),
        ("hf:Qwen/Qwen3-0.6B", "hf_ref", "vllm"),
    ],
)
def test_the_format_of_the_source_names_the_runtime(source, fmt, runtime):
    assert source_format(source) == fmt
    assert runtime_for(source) == runtime
    parsed = parse_layout(layout({"name": "m", "vram": "1GiB", "source": source}))
    assert parsed.domains[0].models[0].runtime == runtime


def test_a_hugging_face_reference_without_a_quantization_may_run_on_either_runtime():
    # GGUF or safetensors is known only once it is resolved: llama-server takes the preferred GGUF
    for runtime in ("llama_server", "vllm"):
        parsed = parse_layout(layout({"name": "m", "vram": "1GiB", "runtime": runtime, "source": "hf:Qwen/Qwen3-0.6B"}))
        assert parsed.domains[0].models[0].runtime == runtime


def test_no_source_and_a_url_is_external_and_the_layout_may_name_the_runtime():
    parsed = parse_layout(layout({"name": "m", "url": "http://10.0.0.5:8000"}))
    assert parsed.domains[0].models[0].runtime == "external"
    named = parse_layout(layout({"name": "m", "vram": "1GiB", "runtime": "vllm", "source": "/srv/model-dir"}))
    assert named.domains[0].models[0].runtime == "vllm"


@pytest.mark.parametrize(
    "model, path, words",
    [
        (
            {"name": "m", "vram": "1GiB", "runtime": "vllm", "source": "/srv/m.gguf"},
            "runtime",
            ["cannot run on vllm", "GGUF file, which runs on llama-server", 'use "runtime": "llama_server"'],
        ),
        (
            {"name": "m", "vram": "1GiB", "runtime": "llama_server", "source": "Qwen/Qwen3-8B"},
            "runtime",
            ["cannot run on llama_server", "not a .gguf file", 'use "runtime": "vllm"'],
        ),
        (
            {"name": "m", "vram": "1GiB", "runtime": "vllm", "source": "ollama:qwen3:0.6b"},
            "runtime",
            ["cannot run on vllm", "names GGUF weights", 'use "runtime": "llama_server"'],
        ),
        (
            {"name": "m", "vram": "1GiB", "runtime": "llama_server"},
            "source",
            ["llama-server needs a GGUF file", "set source to the .gguf file"],
        ),
        ({"name": "m", "vram": "1GiB", "source": "Qwen/x", "gpu_layers": 10}, "gpu_layers", ["llama-server setting"]),
        ({"name": "m", "url": "http://h:1", "adapters": {"a": "/a"}}, "adapters", ["does not launch"]),
    ],
)
def test_a_runtime_that_cannot_serve_the_format_is_refused_saying_why(model, path, words):
    err = refusal(model)
    assert err.path == f"$.domains[0].slots[0].models[0].{path}"
    for w in words:
        assert w in str(err), (w, str(err))


def test_new_model_fields_have_defaults_so_old_declarations_decode():
    old = {"name": "m", "slot": "s", "gpu_index": 0, "runtime": "vllm", "vram_bytes": GiB}
    spec = msgspec.convert(old, ModelSpec)
    assert spec.adapters == {} and spec.gpu_layers == -1


# ------------------------------------------------------------------------- one launch form per binary

API = ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]


@pytest.mark.parametrize(
    "binary, head",
    [
        ([], ["vllm", "serve", "/m/tiny"]),
        (["vllm"], ["vllm", "serve", "/m/tiny"]),
        (["/opt/vllm/bin/vllm"], ["/opt/vllm/bin/vllm", "serve", "/m/tiny"]),
        (SIM, [*SIM, "serve", "/m/tiny"]),
        (API, [*API, "--model", "/m/tiny"]),
    ],
)
def test_each_vllm_form_gets_the_rest_of_its_command_line_from_haru(binary, head):
    spec = ModelSpec(
        name="tiny",
        slot="chat",
        gpu_index=0,
        runtime="vllm",
        source="/m/tiny",
        vram_bytes=2 * GiB,
        context_length=512,
        binary=binary,
    )
    got = launch(spec, gpu_memory_bytes=24 * GiB, port=9000, base_env={})
    assert got.argv == [
        *head,
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--served-model-name",
        "tiny",
        "--gpu-memory-utilization",
        "0.083",
        "--max-model-len",
        "512",
        "--enable-sleep-mode",
    ]
    assert got.env["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_vllm_that_cannot_sleep_is_launched_without_sleep_mode_and_keeps_dev_mode():
    spec = ModelSpec(
        name="tiny",
        slot="chat",
        gpu_index=0,
        runtime="vllm",
        source="/m/tiny",
        vram_bytes=2 * GiB,
        binary=API,
        args=["--enable-sleep-mode", "--dtype", "float32"],
    )
    got = launch(spec, gpu_memory_bytes=24 * GiB, port=9000, base_env={}, sleep_mode=False)
    assert "--enable-sleep-mode" not in got.argv  # the operator's copy too: the plan decides
    assert got.argv[-2:] == ["--dtype", "float32"]
    assert got.env["VLLM_SERVER_DEV_MODE"] == "1"  # /is_sleeping still tells a paused engine from a serving one


@pytest.mark.parametrize(
    "binary",
    [
        ["/usr/local/bin/my-wrapper.sh"],
        ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/x"],
        ["python", "-m", "some.other.server"],
        ["python", "serve.py"],
    ],
)
def test_apply_refuses_a_vllm_binary_it_cannot_drive_naming_the_forms_it_knows(binary):
    doc = {
        "fleet": "f",
        "domains": [
            {
                "name": "a",
                "gpus": [{"index": 0, "memory": "24GiB"}],
                "slots": [
                    {
                        "name": "chat",
                        "gpu": 0,
                        "models": [
                            {"name": "tiny", "runtime": "vllm", "vram": "2GiB", "source": "/m/tiny", "binary": binary}
                        ],
                    }
                ],
            }
        ],
    }
    with pytest.raises(LayoutError) as err:
        parse_layout(json.dumps(doc))
    text = str(err.value)
    assert "not a vLLM program Haru knows how to drive" in text
    assert "vllm.entrypoints.openai.api_server" in text and "vllm serve" in text and "haru.agents.sim.vllm" in text
    assert err.value.path.endswith(".binary")
