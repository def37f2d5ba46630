"""The demo fleets of `haru up --demo`: the layouts it ships, widened to N domains and made runnable here.

    demo_layout(home, DEMO_LAYOUT, domains=0)   the layout, parsed: checkpoints and tiny generated models
                                                 live under $HARU_HOME/demo
    widen(doc, domains)                          pure: the document with that many domains (c, d, ... copied
                                                 from the last, each with its own ports)

The layouts ship inside the package (haru/up/demo/*.json, package data), so `haru up --demo` runs from
an installed wheel; deploy/examples/ keeps the same files for operators to copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from haru.core.errors import ConfigError
from haru.core.layout import parse_layout
from haru.core.specs import Layout

DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet.json"
REAL_DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet-real.json"
VLLM_DEMO_LAYOUT = Path(__file__).resolve().parent / "demo" / "demo-fleet-vllm.json"
MAX_DEMO_DOMAINS = 9


def widen(doc: dict[str, Any], domains: int) -> dict[str, Any]:
    """A layout document with `domains` domains (`haru up --demo --domains N`): the first `domains` of
    it, and as many more as its last domain copied, named c, d, ... each with its own region, serving
    port and model ports (the last domain's, plus 10 per domain added: 18621 -> 18631 -> ...) and
    checkpoints. Pure (a new document); 0 keeps the document as it is."""
    if not domains:
        return doc
    if not 1 <= domains <= MAX_DEMO_DOMAINS:
        raise ConfigError(f"--domains {domains}: a demo fleet has 1 to {MAX_DEMO_DOMAINS} domains")
    out = json.loads(json.dumps(doc))
    have = out.get("domains", [])
    if not have:
        raise ConfigError("the demo layout declares no domain to copy for --domains")
    if domains <= len(have):
        out["domains"] = have[:domains]
        return out
    last = have[-1]
    for k in range(1, domains - len(have) + 1):
        d = json.loads(json.dumps(last))
        name = chr(ord(last["name"][0]) + k) if len(last["name"]) == 1 else f"{last['name']}{k + 1}"
        d["name"] = name
        d["region"] = f"local-{len(have) + k}"
        if d.get("serving_url"):
            base, _, port = d["serving_url"].rpartition(":")
            d["serving_url"] = f"{base}:{int(port) + k}"
        for slot in d.get("slots", []):
            for model in slot.get("models", []):
                if model.get("port"):
                    model["port"] = int(model["port"]) + 10 * k
            if slot.get("checkpoint_dir"):
                slot["checkpoint_dir"] = slot["checkpoint_dir"].replace(f"/{last['name']}/", f"/{name}/")
        have.append(d)
    out["domains"] = have
    return out


def demo_layout(home: Path, path: Path = DEMO_LAYOUT, domains: int = 0) -> Layout:
    """The demo layout made runnable here: tiny generated models and the managed runtimes for the real
    demos, and checkpoints under a home other than ~/.haru. A leading "python" in a binary or a training
    command stays as the file says (each agent runs it with its own interpreter: haru.core.launch
    `with_interpreter`), so re-applying the shipped file to the demo fleet is no change. `domains` (0 =
    as the file says): the fleet widened or narrowed to that many domains (`widen`)."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"cannot read the demo layout {path}: {exc.strerror}; reinstall haru (the demo layouts are its "
            "package data), or pass --layout with a layout of your own"
        ) from None
    doc = widen(doc, domains)
    default_home = Path("~/.haru").expanduser()
    for domain in doc.get("domains", []):
        for slot in domain.get("slots", []):
            if slot.get("kind") == "training" and Path(home).expanduser() != default_home:
                # the shipped files say ~/.haru/demo/...: another home keeps its demo's checkpoints inside it
                slot["checkpoint_dir"] = str(home / "demo" / "checkpoints" / domain["name"] / slot["name"])
            for model in slot.get("models", []):
                if model.get("runtime") == "llama_server":
                    _real_llama_model(model, home)
                if (
                    model.get("runtime") == "vllm"
                    and not model.get("binary")
                    and str(model.get("source", "")).startswith("./")
                ):
                    _real_vllm_model(model, home)
    return parse_layout(doc)


def _real_llama_model(model: dict, home: Path) -> None:
    """A llama-server model of a demo layout made runnable here: the binary built (or found) by
    `agents.runtimes.llama_build`, and a relative `.gguf` source written as a tiny seeded model
    under $HARU_HOME/demo/models (the file name picks the seed: both domains get the same weights)."""
    import zlib

    from haru.agents.runtimes.llama_build import ensure_binary
    from haru.agents.runtimes.tiny_model import write_tiny_model

    if model.get("binary", ["llama-server"]) in ([], ["llama-server"]):
        model["binary"] = [str(ensure_binary(build=True))]
    source = str(model.get("source", ""))
    if source.endswith(".gguf") and not os.path.isabs(source):
        path = home / "demo" / "models" / source
        if not path.exists():
            write_tiny_model(path, seed=zlib.crc32(source.encode()) & 0xFFFF, name=Path(source).stem)
        model["source"] = str(path)


def _real_vllm_model(model: dict, home: Path) -> None:
    """A vLLM model of a demo layout made runnable here: the managed vLLM (made once by
    `agents.runtimes.vllm_env`, ~3.5 GB), and a `./name` source written as a tiny seeded safetensors
    llama under $HARU_HOME/demo/models/name (the name picks the seed: both domains get the same weights)."""
    import subprocess
    import zlib

    from haru.agents import runtimes
    from haru.agents.runtimes.vllm_env import ensure_env, launch_binary

    python = ensure_env(build=True)
    model["binary"] = launch_binary(python)
    name = str(model["source"])[2:].strip("/")
    path = home / "demo" / "models" / name
    if not (path / "model.safetensors").exists():
        # the writer runs in vLLM's interpreter: it has sentencepiece, numpy and safetensors
        subprocess.run(
            [
                str(python),
                str(Path(runtimes.__file__).parent / "tiny_hf_model.py"),
                str(path),
                "--seed",
                str(zlib.crc32(name.encode()) & 0xFFFF),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    model["source"] = str(path)
