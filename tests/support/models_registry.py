"""A model registry on 127.0.0.1 for the tests: the Ollama registry's v2 endpoints and Hugging Face's
model-info and `resolve/{revision}/{file}` endpoints, over files the tests generate.

    python -m tests.support.models_registry --root DIR --port N [--rate BYTES_PER_S] [--log FILE]

DIR holds `registry.json` (written by `Registry.save`): Ollama models (manifest layers -> files) and
HF repositories (file name -> path, LFS or not, commit). What it speaks, as the real ones do:

- `GET /v2/<ns>/<name>/manifests/<tag>`  the v2 manifest (config + layers with digests and sizes);
- `GET /v2/<ns>/<name>/blobs/<digest>`   307 to `/cdn/<digest>` (a CDN elsewhere, in real life: `Registry.cdn`
  names another server's origin for it, e.g. a second `Server` on the same DIR);
- `GET /api/models/<org>/<repo>/revision/<rev>?blobs=true`  `{id, sha, siblings[{rfilename, size,
  blobId, lfs{sha256,size}}]}`;
- `HEAD|GET /<org>/<repo>/resolve/<rev>/<file>`  an LFS file: 302 to `/cdn/<sha256>` with
  `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit`; a small file: 200 with `ETag` = git's blob id;
- `GET /cdn/<digest>`  the bytes, honouring `Range: bytes=N-` (206 + Content-Range);
- faults, set per run by `registry.json`'s `faults`: `token` (401 without `Authorization: Bearer
  <token>`), `corrupt` (digest -> serve other bytes of the same size), `short` (digest -> claim the
  full Content-Length and close after N bytes), `stall` (digest -> send N bytes, then nothing, until
  the client hangs up), `truncate` (digest -> a shorter body, honestly labelled), `ignore_range`
  (digests answered 200 and the whole body whatever the Range), `chunked` (digests sent with chunked
  transfer encoding, no Content-Length), `missing` (digest -> 404), `info_sha256` (file -> the model
  info's lfs sha256, '' = none);
- every request is one JSON line in `--log` (method, path, range, whether it carried an
  `Authorization`), so a test sees what was fetched and who was given credentials;
- `--rate` throttles bodies (bytes a second), so a test can kill the server mid-download.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np
from aiohttp import web

from haru.agents.runtimes.tiny_model import write_tiny_model


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Registry:
    """What the server serves, kept in DIR/registry.json so a server process restarted later serves the same."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.doc: dict = {"blobs": {}, "ollama": {}, "hf": {}, "faults": {}, "aliases": {}}
        if (root / "registry.json").exists():
            self.doc = json.loads((root / "registry.json").read_text())

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "registry.json").write_text(json.dumps(self.doc, indent=1))

    def add_blob(self, path: Path) -> tuple[str, int]:
        digest = "sha256:" + sha256_file(path)
        self.doc["blobs"][digest] = str(path)
        return digest, path.stat().st_size

    def add_ollama(self, name: str, tag: str, gguf: Path, *, template: str = "{{ .Prompt }}") -> None:
        tpl = self.root / f"{name.replace('/', '_')}-{tag}.template"
        tpl.write_text(template)
        cfg = self.root / f"{name.replace('/', '_')}-{tag}.config.json"
        cfg.write_text(json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "F32"}))
        layers = []
        for path, media in (
            (gguf, "application/vnd.ollama.image.model"),
            (tpl, "application/vnd.ollama.image.template"),
        ):
            d, n = self.add_blob(path)
            layers.append({"mediaType": media, "digest": d, "size": n})
        cd, cn = self.add_blob(cfg)
        self.doc["ollama"][f"{name}:{tag}"] = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": cd, "size": cn},
            "layers": layers,
        }

    def add_hf(
        self, repo: str, files: dict[str, Path], *, lfs_suffixes=(".gguf", ".safetensors"), commit: str = ""
    ) -> str:
        commit = commit or hashlib.sha1(repo.encode() + b"".join(sorted(f.encode() for f in files))).hexdigest()
        entries = {}
        for name, path in files.items():
            data = path.read_bytes()
            lfs = name.endswith(lfs_suffixes)
            entry = {"path": str(path), "size": len(data), "lfs": lfs, "blob_id": git_blob_id(data)}
            if lfs:
                entry["sha256"] = hashlib.sha256(data).hexdigest()
                self.doc["blobs"]["sha256:" + entry["sha256"]] = str(path)
            entries[name] = entry
        self.doc["hf"][repo] = {"sha": commit, "files": entries}
        return commit

    def alias(self, old: str, new: str) -> None:
        """`old` was renamed to `new`: both endpoints redirect (relative), as the Hub does."""
        self.doc.setdefault("aliases", {})[old] = new

    def cdn(self, origin: str) -> None:
        """Blob redirects point at `origin` (another server serving the same DIR) instead of this one."""
        self.doc["cdn"] = origin
        self.save()

    def fault(self, kind: str, value) -> None:
        self.doc["faults"][kind] = value
        self.save()

    def clear_faults(self) -> None:
        self.doc["faults"] = {}
        self.save()


FAULTS_ON_BODIES = ("corrupt", "truncate", "short", "stall", "ignore_range", "chunked")


def app(root: Path, *, rate: int = 0, log: Path | None = None) -> web.Application:
    reg_path = root / "registry.json"

    def doc() -> dict:
        return json.loads(reg_path.read_text())  # re-read per request: tests change faults between pulls

    def note(request: web.Request, **extra) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "method": request.method,
                            "path": request.path,
                            "range": request.headers.get("Range", ""),
                            "auth": "Authorization" in request.headers,
                            **extra,
                        }
                    )
                    + "\n"
                )

    def authorized(request: web.Request, d: dict) -> bool:
        token = d["faults"].get("token")
        return not token or request.headers.get("Authorization") == f"Bearer {token}"

    async def manifest(request: web.Request) -> web.StreamResponse:
        d = doc()
        note(request)
        if not authorized(request, d):
            return web.json_response(
                {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}, status=401
            )
        key = f"{request.match_info['ns']}/{request.match_info['name']}:{request.match_info['tag']}"
        m = d["ollama"].get(key)
        if m is None:
            return web.json_response(
                {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}, status=404
            )
        return web.json_response(m, content_type="application/vnd.docker.distribution.manifest.v2+json")

    async def ollama_blob(request: web.Request) -> web.StreamResponse:
        d = doc()
        note(request)
        if not authorized(request, d):
            return web.json_response({"errors": [{"code": "UNAUTHORIZED"}]}, status=401)
        raise web.HTTPTemporaryRedirect(f"{d.get('cdn', '')}/cdn/{request.match_info['digest']}")

    async def model_info(request: web.Request) -> web.StreamResponse:
        d = doc()
        note(request)
        if not authorized(request, d):
            return web.json_response({"error": "Invalid credentials in Authorization header"}, status=401)
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        if repo in d.get("aliases", {}):  # a renamed repository: the Hub answers with a relative redirect
            raise web.HTTPTemporaryRedirect(
                f"/api/models/{d['aliases'][repo]}/revision/{request.match_info['rev']}?{request.query_string}"
            )
        r = d["hf"].get(repo)
        if r is None:
            return web.json_response({"error": "Repository not found"}, status=404)
        siblings = []
        for name, e in sorted(r["files"].items()):
            s = {"rfilename": name, "size": e["size"], "blobId": e["blob_id"]}
            info = d["faults"].get("info_sha256", {})  # the model info says another digest than the file
            if e["lfs"] and info.get(name) != "":
                s["lfs"] = {"sha256": info.get(name, e["sha256"]), "size": e["size"], "pointerSize": 134}
            siblings.append(s)
        return web.json_response({"id": repo, "sha": r["sha"], "siblings": siblings})

    async def resolve_file(request: web.Request) -> web.StreamResponse:
        d = doc()
        note(request)
        if not authorized(request, d):
            return web.Response(status=401, text="Invalid credentials")
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        if repo in d.get("aliases", {}):
            raise web.HTTPTemporaryRedirect(
                f"/{d['aliases'][repo]}/resolve/{request.match_info['rev']}/{request.match_info['file']}"
            )
        r = d["hf"].get(repo)
        name = request.match_info["file"]
        e = (r or {}).get("files", {}).get(name)
        if r is None or e is None or request.match_info["rev"] not in (r["sha"], "main"):
            return web.Response(status=404, text="Entry not found", headers={"X-Error-Code": "EntryNotFound"})
        if e["lfs"]:
            headers = {
                "X-Linked-Etag": f'"{e["sha256"]}"',
                "X-Linked-Size": str(e["size"]),
                "ETag": f'"{e["blob_id"]}"',
                "X-Repo-Commit": r["sha"],
                "Location": f"/cdn/sha256:{e['sha256']}",
            }
            # absolute, to "another host" (the real Hub sends its CDN's URL): a resolver stops here and reads X-Linked-*
            headers["Location"] = f"{d.get('cdn') or request.url.origin()}/cdn/sha256:{e['sha256']}"
            return web.Response(status=302, headers=headers)
        return await _body(
            request,
            Path(e["path"]),
            f"gitsha1:{e['blob_id']}",
            d,
            {"ETag": f'"{e["blob_id"]}"', "X-Repo-Commit": r["sha"]},
        )

    async def cdn(request: web.Request) -> web.StreamResponse:
        d = doc()
        note(request)
        digest = request.match_info["digest"]
        path = d["blobs"].get(digest)
        if path is None or digest in d["faults"].get("missing", []):
            return web.Response(status=404, text="NoSuchKey")
        return await _body(request, Path(path), digest, d, {})

    async def _body(request: web.Request, path: Path, digest: str, d: dict, headers: dict) -> web.StreamResponse:
        faults = d["faults"]
        if not headers and not rate and not any(digest in faults.get(k, {}) for k in FAULTS_ON_BODIES):
            # A CDN's blob (no headers of the registry's own to keep: aiohttp sets its ETag) is served as a CDN
            # serves it: sendfile, Range and HEAD by aiohttp, no Python loop over the bytes (which took a
            # core of its own from a 2-core machine in bench/pull.py, curl's and Haru's alike).
            total = path.stat().st_size
            rng = request.headers.get("Range", "")
            start = int(rng[6:-1]) if rng.startswith("bytes=") and rng.endswith("-") else 0
            if request.method != "HEAD" and start < total:
                note(request, served=total - start, start=start)
            return web.FileResponse(path, headers={**headers, "Accept-Ranges": "bytes"})
        data = path.read_bytes()
        corrupt = d["faults"].get("corrupt", {})
        if digest in corrupt:
            at = int(corrupt[digest])
            data = data[:at] + bytes(b ^ 0xFF for b in data[at : at + 64]) + data[at + 64 :]
        total = len(data)
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(total)})
        start = 0
        rng = request.headers.get("Range", "") if digest not in faults.get("ignore_range", []) else ""
        status = 200
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            if start >= total:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{total}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{total - 1}/{total}"
        body = data[start:]
        truncate = d["faults"].get("truncate", {})
        if digest in truncate:
            body = body[: int(truncate[digest])]
        short = d["faults"].get("short", {})
        cut = int(short[digest]) if digest in short else None
        stall = d["faults"].get("stall", {})
        hold = int(stall[digest]) if digest in stall else None
        resp = web.StreamResponse(
            status=status, headers={**headers, "Content-Length": str(len(body)), "Accept-Ranges": "bytes"}
        )
        if digest in faults.get("chunked", []):
            del resp.headers["Content-Length"]
            resp.enable_chunked_encoding()  # no length: the client learns the size at the last chunk
        await resp.prepare(request)
        step = 65536
        sent = 0
        while sent < len(body):
            chunk = body[sent : sent + step]
            if cut is not None and sent + len(chunk) > cut:
                await resp.write(chunk[: cut - sent])
                request.transport.close()  # the connection drops mid-body
                return resp
            if hold is not None and sent + len(chunk) > hold:
                await resp.write(chunk[: hold - sent])
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.05)  # the server goes quiet, the connection stays open
                return resp
            await resp.write(chunk)
            sent += len(chunk)
            if rate:
                await asyncio.sleep(len(chunk) / rate)
        note(request, served=sent, start=start)
        await resp.write_eof()
        return resp

    a = web.Application()
    a.router.add_get("/v2/{ns}/{name}/manifests/{tag}", manifest)
    a.router.add_get("/v2/{ns}/{name}/blobs/{digest}", ollama_blob)
    a.router.add_get("/api/models/{org}/{repo}/revision/{rev}", model_info)
    a.router.add_route("*", "/{org}/{repo}/resolve/{rev}/{file:.+}", resolve_file)
    a.router.add_route("*", "/cdn/{digest}", cdn)
    return a


class Server:
    """The registry served in this process (for tests that need no process to kill)."""

    def __init__(self, root: Path, *, rate: int = 0, log: Path | None = None) -> None:
        self.root, self.rate, self.log = root, rate, log
        self.url = ""

    async def __aenter__(self) -> Server:
        self.runner = web.AppRunner(app(self.root, rate=self.rate, log=self.log), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def write_safetensors(path: Path, tensors: dict[str, object]) -> Path:
    """A safetensors file from numpy arrays (the format: u64 header length, JSON header, raw data)."""
    import numpy as np

    header: dict = {}
    blobs = []
    offset = 0
    dtypes = {np.dtype("float32"): "F32", np.dtype("float16"): "F16"}
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr)
        raw = a.tobytes()
        header[name] = {"dtype": dtypes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=int, default=0)
    p.add_argument("--log", default=None)
    args = p.parse_args(argv)
    web.run_app(
        app(Path(args.root), rate=args.rate, log=Path(args.log) if args.log else None),
        host="127.0.0.1",
        port=args.port,
        print=lambda *_: print("ready", flush=True),
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


def build_registry(root: Path) -> Registry:
    files = root / "files"
    files.mkdir(parents=True)
    reg = Registry(root)
    reg.add_ollama("library/tiny", "1b", write_tiny_model(files / "tiny.gguf", seed=1))
    reg.add_hf(
        "acme/tiny-GGUF",
        {
            "tiny-Q8_0.gguf": write_tiny_model(files / "q8.gguf", seed=2),
            "tiny-Q4_K_M.gguf": write_tiny_model(files / "q4.gguf", seed=3),
            "README.md": _text(files / "README.md", "# tiny\n"),
        },
    )
    rng = np.random.default_rng(7)
    reg.add_hf(
        "acme/tiny",
        {
            "config.json": _text(files / "config.json", json.dumps({"architectures": ["LlamaForCausalLM"]})),
            "model.safetensors": write_safetensors(
                files / "model.safetensors", {"w": rng.standard_normal((64, 64)).astype(np.float32)}
            ),
            "tokenizer.json": _text(files / "tokenizer.json", "{}"),
            "tokenizer_config.json": _text(files / "tokenizer_config.json", "{}"),
            "notes/extra.safetensors": files / "model.safetensors",  # not at the top: not part of the package
        },
    )
    reg.add_hf("acme/empty", {"README.md": files / "README.md"})
    reg.alias("acme/old-tiny-GGUF", "acme/tiny-GGUF")
    reg.save()
    return reg


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
