"""`haru resolve`: ask a registry what a reference names, and fetch nothing but metadata.

Ollama registry (v2, Docker-distribution style):
    GET  {base}/v2/{ns}/{name}/manifests/{tag}     the manifest: config + layers, each digest and size
    blob {base}/v2/{ns}/{name}/blobs/{digest}      (a redirect to a CDN, followed when pulling)

Hugging Face:
    GET  {endpoint}/api/models/{repo}/revision/{rev}?blobs=true   the commit and the file list
    HEAD {endpoint}/{repo}/resolve/{commit}/{file}                 per chosen file, redirects not
         followed: `X-Linked-Etag` (the LFS sha256) and `X-Linked-Size` for LFS files, `ETag` (git's
         blob id) and `Content-Length` for small files kept in git. Relative redirects (a renamed
         repository) are followed; an absolute one is where the bytes are, and is not.

Settings (`Settings.from_env`): `HF_ENDPOINT` (default https://huggingface.co), `HF_TOKEN` (sent
as a bearer token to the Hub only), `HARU_OLLAMA_REGISTRY` (default https://registry.ollama.ai) and
`HARU_GGUF_QUANTS` (comma-separated preference, default Q4_K_M,Q5_K_M,Q8_0,...).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from urllib.parse import quote, urljoin, urlsplit

import aiohttp
import msgspec

from haru.core import refs
from haru.core.model_errors import BadReference, NotFound, RegistryError, Unauthorized
from haru.core.refs import Blob, Ref, Resolution

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_OLLAMA_REGISTRY = "https://registry.ollama.ai"
MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
USER_AGENT = "haru/0.1 (+model pull)"
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=15, sock_read=60)


@dataclass(frozen=True)
class Settings:
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    hf_token: str = ""
    ollama_registry: str = DEFAULT_OLLAMA_REGISTRY
    quants: tuple[str, ...] = refs.DEFAULT_QUANTS

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, quants: str = "") -> Settings:
        env = dict(os.environ if env is None else env)
        pref = quants or env.get("HARU_GGUF_QUANTS", "")
        return cls(
            hf_endpoint=(env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/"),
            hf_token=env.get("HF_TOKEN", "") or env.get("HUGGING_FACE_HUB_TOKEN", ""),
            ollama_registry=(env.get("HARU_OLLAMA_REGISTRY") or DEFAULT_OLLAMA_REGISTRY).rstrip("/"),
            quants=tuple(q.strip().upper() for q in pref.split(",") if q.strip()) or refs.DEFAULT_QUANTS,
        )

    def headers_for(self, url: str) -> dict[str, str]:
        """Credentials go only to the registry they belong to (never to a CDN a redirect names)."""
        h = {"User-Agent": USER_AGENT}
        if self.hf_token and _same_origin(url, self.hf_endpoint):
            h["Authorization"] = f"Bearer {self.hf_token}"
        return h


def _same_origin(a: str, b: str) -> bool:
    x, y = urlsplit(a), urlsplit(b)
    return (x.scheme, x.netloc) == (y.scheme, y.netloc)


def session(settings: Settings | None = None) -> aiohttp.ClientSession:
    """For resolution (blob bodies go through `haru.models.download`, with this session's timeouts)."""
    return aiohttp.ClientSession(timeout=TIMEOUT, headers={"User-Agent": USER_AGENT})


def registry_error(url: str, status: int, body: str, what: str, *, hint: str = "") -> RegistryError:
    """A registry's error answer as one of ours, in its own words (the first 200 characters)."""
    said = " ".join(body.split())[:200]
    said = f": {said}" if said else ""
    if status == 404:
        return NotFound(f"{what} not found (404 from {url}){said}{'; ' + hint if hint else ''}", url=url, status=status)
    if status in (401, 403):
        fix = (
            "set HF_TOKEN to a token with access to it"
            if "/api/models/" in url or "/resolve/" in url
            else "the registry wants credentials Haru does not have for it"
        )
        return Unauthorized(f"{what}: {status} from {url}{said}; {fix}", url=url, status=status)
    return RegistryError(f"{what}: HTTP {status} from {url}{said}", url=url, status=status)


async def resolve(ref: Ref | str, settings: Settings, http: aiohttp.ClientSession) -> Resolution:
    """What `ref` names: every blob with URL, size and digest, the format and the runtime."""
    if isinstance(ref, str):
        ref = refs.parse_reference(ref)
    try:
        if ref.registry == "ollama":
            return await _resolve_ollama(ref, settings, http)
        return await _resolve_hf(ref, settings, http)
    except aiohttp.ClientError as exc:
        raise RegistryError(
            f"cannot reach the registry for {ref}: {exc}; check the network or the registry "
            f"URL (HF_ENDPOINT / HARU_OLLAMA_REGISTRY)"
        ) from exc


async def _resolve_ollama(ref: Ref, settings: Settings, http: aiohttp.ClientSession) -> Resolution:
    base = f"https://{ref.host}" if ref.host else settings.ollama_registry
    url = f"{base}/v2/{ref.repo}/manifests/{ref.tag}"
    async with http.get(url, headers={**settings.headers_for(url), "Accept": MANIFEST_ACCEPT}) as resp:
        text = await resp.text(errors="replace")
        if resp.status != 200:
            raise registry_error(
                url, resp.status, text, f"Ollama model {ref.repo}:{ref.tag}", hint=f"check the name and tag on {base}"
            )
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise RegistryError(f"the manifest at {url} is not JSON ({exc})", url=url, status=200) from exc
    blobs = refs.ollama_blobs(manifest, lambda d: f"{base}/v2/{ref.repo}/blobs/{d}")
    return Resolution(
        reference=str(ref),
        registry="ollama",
        origin=base,
        repository=ref.repo,
        revision=ref.tag,
        format="gguf",
        runtime=refs.RUNTIME_OF["gguf"],
        entry="model.gguf",
        blobs=blobs,
    )


async def _resolve_hf(ref: Ref, settings: Settings, http: aiohttp.ClientSession) -> Resolution:
    ep = settings.hf_endpoint
    revision = ref.revision or "main"
    url = f"{ep}/api/models/{ref.repo}/revision/{quote(revision, safe='')}?blobs=true"
    async with http.get(url, headers=settings.headers_for(url)) as resp:
        text = await resp.text(errors="replace")
        if resp.status != 200:
            raise registry_error(
                url,
                resp.status,
                text,
                f"Hugging Face repository {ref.repo}@{revision}",
                hint="check the ORG/REPO spelling and the revision",
            )
    try:
        info = json.loads(text)
        commit = str(info.get("sha") or "")
        siblings = {s["rfilename"]: s for s in info.get("siblings") or []}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RegistryError(f"the model info at {url} is not what the Hub sends ({exc})", url=url, status=200) from exc
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise RegistryError(f"the model info at {url} names no commit (sha {commit!r})", url=url, status=200)
    names = sorted(siblings)
    quant, chosen = refs.gguf_choice(names, ref.quant, settings.quants)
    fmt: refs.Format = "gguf"
    if not chosen:
        if ref.quant:
            raise BadReference(
                f"{ref}: the repository has no GGUF files, so no {ref.quant}; drop ':{ref.quant}' "
                "to take its safetensors"
            )
        chosen = refs.safetensors_package(names)
        fmt = "safetensors"
        if not chosen:
            raise BadReference(
                f"{ref}: the repository at revision {commit[:12]} has neither GGUF files nor a "
                f"safetensors model (config.json + *.safetensors); it has {', '.join(names[:12]) or 'no files'}"
            )
    blobs = [await _hf_blob(ref, commit, name, siblings[name], settings, http) for name in chosen]
    entry = ""
    if fmt == "gguf":
        blobs = [msgspec.structs.replace(b, name=b.name.rsplit("/", 1)[-1]) for b in blobs]  # shards side by side
        entry = blobs[0].name
    return Resolution(
        reference=str(ref),
        registry="hf",
        origin=ep,
        repository=ref.repo,
        revision=commit,
        format=fmt,
        runtime=refs.RUNTIME_OF[fmt],
        quant=quant if fmt == "gguf" else "",
        entry=entry,
        blobs=blobs,
    )


def _unquote_etag(value: str) -> str:
    v = value.strip()
    if v.startswith("W/"):
        v = v[2:]
    return v.strip('"')


async def _hf_blob(
    ref: Ref, commit: str, name: str, sibling: dict, settings: Settings, http: aiohttp.ClientSession
) -> Blob:
    url = f"{settings.hf_endpoint}/{ref.repo}/resolve/{commit}/{quote(name)}"
    head_url = url
    for _ in range(5):
        async with http.head(head_url, headers=settings.headers_for(head_url), allow_redirects=False) as resp:
            headers = resp.headers
            status = resp.status
        location = headers.get("Location", "")
        if status in (301, 302, 303, 307, 308) and location and not urlsplit(location).netloc:
            head_url = urljoin(head_url, location)  # a renamed repository: follow, still on the Hub
            continue
        break
    if status >= 400:
        raise registry_error(head_url, status, "", f"{ref.repo}/{name} at {commit[:12]}")
    linked = _unquote_etag(headers.get("X-Linked-Etag", ""))
    etag = _unquote_etag(headers.get("ETag", ""))
    size_text = headers.get("X-Linked-Size") or (headers.get("Content-Length") if not linked else "")
    lfs = sibling.get("lfs") or {}
    if linked and re.fullmatch(r"[0-9a-f]{64}", linked):
        digest = f"sha256:{linked}"
    elif re.fullmatch(r"[0-9a-f]{64}", etag):
        digest = f"sha256:{etag}"
    elif re.fullmatch(r"[0-9a-f]{40}", etag):
        digest = f"gitsha1:{etag}"
    elif lfs.get("sha256"):
        digest = f"sha256:{lfs['sha256']}"
    else:
        raise RegistryError(
            f"{head_url} gave no digest for {name} (no X-Linked-Etag or ETag); cannot verify it, "
            "so Haru will not fetch it",
            url=head_url,
            status=status,
        )
    if lfs.get("sha256") and digest != f"sha256:{lfs['sha256']}":
        raise RegistryError(
            f"the Hub disagrees with itself about {name}: model info says sha256 {lfs['sha256']}, "
            f"the file's headers {digest}",
            url=head_url,
            status=status,
        )
    try:
        size = int(size_text) if size_text else int(lfs.get("size", sibling.get("size")))  # type: ignore[arg-type]  # None -> TypeError, below
    except (TypeError, ValueError):
        raise RegistryError(
            f"{head_url} gave no size for {name} (no X-Linked-Size or Content-Length)", url=head_url, status=status
        ) from None
    return Blob(name=name, url=url, size=size, digest=digest, role=refs.role_of(name))
