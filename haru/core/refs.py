"""Model references and what to fetch for them: the pure part of `haru resolve` (no I/O).

One syntax names a model in either registry:

    qwen3:0.6b                       the Ollama registry, namespace `library`, tag `0.6b`
    library/qwen3:0.6b               the same, namespace explicit
    ollama:qwen3  ollama:NS/NAME:TAG the same, prefix explicit (tag `latest` when omitted)
    HOST/NS/NAME:TAG                 another Ollama-protocol registry (`https://HOST`)
    hf:ORG/REPO[:QUANT][@REVISION]   a Hugging Face repository (revision `main` when omitted)
    hf.co/ORG/REPO[:QUANT]           the same, as Ollama spells it

`is_reference` tells a reference from a path (`/…`, `./…`, `~/…`, `…/file.gguf`). What the
registries answer is turned into a `Resolution` here too: `gguf_choice` picks a quantization by
preference, `safetensors_package` the files a safetensors model needs, `ollama_blobs` the layers of
an Ollama manifest. The HTTP around it is `haru.models.resolve`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

import msgspec

from haru.core.model_errors import BadReference

Registry = Literal["ollama", "hf"]
Format = Literal["gguf", "safetensors"]

DEFAULT_QUANTS: tuple[str, ...] = (
    "Q4_K_M",
    "Q5_K_M",
    "Q8_0",
    "Q6_K",
    "Q4_K_S",
    "Q5_K_S",
    "Q4_0",
    "IQ4_XS",
    "Q3_K_M",
    "BF16",
    "F16",
    "F32",
)
RUNTIME_OF: dict[str, str] = {"gguf": "llama_server", "safetensors": "vllm"}

_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_OLLAMA_PART = re.compile(r"[a-z0-9][a-z0-9._-]{0,79}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_QUANT_IN_NAME = re.compile(r"(?<![A-Z0-9])(I?Q[1-8](?:_[A-Z0-9]{1,2})*|BF16|F16|F32)(?![A-Z0-9])")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Ref:
    """A parsed reference. `host` is set only for an Ollama registry named in the reference itself."""

    registry: Registry
    repo: str  # `library/qwen3` or `Qwen/Qwen3-0.6B-GGUF`
    tag: str = ""  # Ollama's tag
    quant: str = ""  # Hugging Face: the GGUF quantization asked for ('' = by preference)
    revision: str = ""  # Hugging Face: branch, tag or commit ('' = main)
    host: str = ""

    def __str__(self) -> str:
        if self.registry == "ollama":
            return f"ollama:{self.host + '/' if self.host else ''}{self.repo}:{self.tag}"
        return f"hf:{self.repo}{':' + self.quant if self.quant else ''}{'@' + self.revision if self.revision else ''}"


EXPLICIT_PREFIXES = ("hf:", "ollama:", "hf.co/", "huggingface.co/")


def is_explicit_reference(text: str) -> bool:
    """A layout's `source` is pulled only when it says so with a prefix: a bare `Qwen/Qwen3-0.6B` there is
    a Hugging Face id vLLM fetches itself, and `sim/m1` the simulator's name, not Ollama models."""
    return text.startswith(EXPLICIT_PREFIXES)


def is_reference(text: str) -> bool:
    """True when `text` names a registry model rather than a file or directory on this host."""
    if is_explicit_reference(text):
        return True
    if text.startswith(("/", "./", "../", "~", "file:")) or text in (".", ".."):
        return False
    if text.lower().endswith((".gguf", ".safetensors")):
        return False
    try:
        parse_reference(text)
    except BadReference:
        return False
    return True


def parse_reference(text: str) -> Ref:
    """Parse one reference. Raises BadReference naming the part that is wrong and the forms that work."""
    raw = text.strip()
    if not raw:
        raise BadReference("empty model reference; write e.g. `qwen3:0.6b` or `hf:Qwen/Qwen3-0.6B-GGUF`")
    for prefix in ("hf.co/", "huggingface.co/"):
        if raw.startswith(prefix):
            return _parse_hf(raw[len(prefix) :], text)
    if raw.startswith("hf:"):
        return _parse_hf(raw[3:], text)
    if raw.startswith("ollama:"):
        raw = raw[len("ollama:") :]
    return _parse_ollama(raw, text)


def _parse_hf(body: str, text: str) -> Ref:
    revision = ""
    if "@" in body:
        body, revision = body.split("@", 1)
        if not revision or any(c.isspace() for c in revision):
            raise BadReference(f"{text!r}: the revision after '@' is empty; write hf:ORG/REPO@main or a commit")
    quant = ""
    if ":" in body:
        body, quant = body.split(":", 1)
        if not _TAG.fullmatch(quant):
            raise BadReference(f"{text!r}: {quant!r} is not a quantization; write e.g. hf:{body}:Q4_K_M")
    parts = body.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts):
        raise BadReference(
            f"{text!r}: a Hugging Face repository is ORG/REPO (letters, digits, '.', '_', '-'); "
            "write hf:ORG/REPO[:QUANT][@REVISION], e.g. hf:Qwen/Qwen3-0.6B-GGUF:Q4_K_M"
        )
    return Ref(registry="hf", repo=body, quant=quant.upper(), revision=revision)


def _parse_ollama(body: str, text: str) -> Ref:
    tag = "latest"
    name = body
    last = body.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = body.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise BadReference(f"{text!r}: {tag!r} is not an Ollama tag; write NAME:TAG, e.g. qwen3:0.6b")
    parts = name.split("/")
    host = ""
    if len(parts) == 3 and "." in parts[0] or len(parts) == 3 and ":" in parts[0]:
        host, parts = parts[0], parts[1:]
    if len(parts) == 1:
        parts = ["library", parts[0]]
    if len(parts) != 2 or not all(_OLLAMA_PART.fullmatch(p) for p in parts):
        raise BadReference(
            f"{text!r} is not a model reference: an Ollama name is [NAMESPACE/]NAME[:TAG] in lowercase "
            "(e.g. qwen3:0.6b), a Hugging Face one hf:ORG/REPO[:QUANT][@REVISION]; a file path "
            "starts with '/', './' or '~'"
        )
    return Ref(registry="ollama", repo="/".join(parts), tag=tag, host=host)


# ------------------------------------------------------------------------------------- resolution


class Blob(msgspec.Struct, frozen=True, kw_only=True):
    """One file to fetch: where it goes in the materialized model, where from, how big, what it hashes to.

    `digest` is `sha256:<hex>`, or for a small file a Hugging Face repository keeps in git (not LFS)
    `gitsha1:<hex>`: git's blob id, sha1 of `blob <size>\\0<bytes>`, the only digest the Hub publishes
    for such files.
    """

    name: str
    url: str
    size: int
    digest: str
    role: str = ""  # weights | index | config | tokenizer | template | params | license | projector | other


class Resolution(msgspec.Struct, frozen=True, kw_only=True):
    reference: str  # canonical
    registry: Registry
    origin: str  # the registry's base URL
    repository: str
    revision: str  # Ollama tag, or the Hugging Face commit the files were pinned to
    format: Format
    runtime: str  # llama_server | vllm
    quant: str = ""
    entry: str = ""  # the file to serve (GGUF: the first or only file); '' = the directory
    blobs: list[Blob] = []

    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    @property
    def key(self) -> str:
        """Where the materialized model lives under the store's `refs/`: readable and unique per reference."""
        host = self.origin.split("://", 1)[-1].rstrip("/").replace("/", "_").replace(":", "_")
        tail = (
            self.revision
            if self.registry == "ollama"
            else f"{self.revision[:12]}{'-' + self.quant if self.quant else ''}"
        )
        return f"{self.registry}/{host}/{self.repository}/{tail}"


def quant_of(filename: str) -> str:
    """The quantization a GGUF file name states (`Qwen3-0.6B-Q4_K_M.gguf` -> `Q4_K_M`), or ''."""
    stem = PurePosixPath(filename).name.upper()
    stem = _SHARD.sub(".GGUF", stem)
    found = _QUANT_IN_NAME.findall(stem.replace(".", "-"))
    return found[-1] if found else ""


def _is_gguf_model(name: str) -> bool:
    low = PurePosixPath(name).name.lower()
    return low.endswith(".gguf") and "mmproj" not in low


def gguf_choice(files: list[str], quant: str, preference: tuple[str, ...]) -> tuple[str, list[str]]:
    """The quantization to fetch and its files (shards in order). `quant` asked for is binding;
    otherwise the first of `preference` the repository has, else the first in name order."""
    by_quant: dict[str, list[str]] = {}
    for f in files:
        if _is_gguf_model(f):
            by_quant.setdefault(quant_of(f) or PurePosixPath(f).name, []).append(f)
    if not by_quant:
        return "", []
    if quant:
        if quant.upper() not in by_quant:
            raise BadReference(f"no {quant.upper()} GGUF in this repository; it has {', '.join(sorted(by_quant))}")
        chosen = quant.upper()
    else:
        chosen = next((q for q in preference if q in by_quant), sorted(by_quant)[0])
    return chosen, sorted(by_quant[chosen])


_PACKAGE_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
    }
)


def role_of(name: str) -> str:
    low = name.lower()
    if low.endswith(".safetensors") or low.endswith(".gguf") and "mmproj" not in low:
        return "weights"
    if "mmproj" in low:
        return "projector"
    if low.endswith(".safetensors.index.json"):
        return "index"
    if low in ("config.json", "generation_config.json", "preprocessor_config.json"):
        return "config"
    if low.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")):
        return "tokenizer"
    return "other"


def safetensors_package(files: list[str]) -> list[str]:
    """The files of a safetensors model at the repository's top level: weights (or shards), their
    index, config and tokenizer. Empty when there is no config.json or no weights."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    if "config.json" not in top or not weights:
        return []
    return sorted(
        f for f in top if f in _PACKAGE_FILES or f.endswith(".safetensors") or f.endswith(".safetensors.index.json")
    )


OLLAMA_LAYER_NAMES: dict[str, tuple[str, str]] = {
    "application/vnd.ollama.image.model": ("model.gguf", "weights"),
    "application/vnd.ollama.image.projector": ("mmproj.gguf", "projector"),
    "application/vnd.ollama.image.template": ("template", "template"),
    "application/vnd.ollama.image.params": ("params", "params"),
    "application/vnd.ollama.image.system": ("system", "other"),
    "application/vnd.ollama.image.license": ("license", "license"),
    "application/vnd.docker.container.image.v1+json": ("config.json", "config"),
}


def ollama_blobs(manifest: dict[str, Any], blob_url: Callable[[str], str]) -> list[Blob]:
    """The blobs of an Ollama v2 manifest, named for the materialized directory. `blob_url(digest)` gives
    each one's URL. Raises BadReference when the manifest holds no model layer."""
    layers = [manifest.get("config") or {}, *(manifest.get("layers") or [])]
    out: list[Blob] = []
    seen: dict[str, int] = {}
    for layer in layers:
        media, digest, size = layer.get("mediaType", ""), layer.get("digest", ""), layer.get("size")
        if not digest or not isinstance(size, int):
            continue
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise BadReference(f"the manifest names a layer digest {digest!r}, not sha256:<64 hex>; refusing it")
        name, role = OLLAMA_LAYER_NAMES.get(media, (f"layer-{digest[7:19]}", "other"))
        n = seen.get(name, 0)
        seen[name] = n + 1
        if n:
            name = f"{name}.{n}"
        out.append(Blob(name=name, url=blob_url(digest), size=size, digest=digest, role=role))
    if not any(b.role == "weights" for b in out):
        raise BadReference("the Ollama manifest has no model layer (application/vnd.ollama.image.model)")
    return out
