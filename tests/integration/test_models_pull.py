"""`haru resolve` and `haru pull` against a registry on 127.0.0.1 that speaks Ollama's v2 and Hugging
Face's endpoints (tests/support/models_registry.py), over a tiny GGUF and a tiny safetensors package made here."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from haru.core import model_errors as E
from haru.models import resolve as R
from haru.models.download import WRITE_BEHIND
from haru.models.pull import pull
from haru.models.store import Store
from tests.support import haru
from tests.support.models_registry import Server, build_registry
from tests.support.ports import lasting_port


def settings_for(url: str, **kw) -> R.Settings:
    return R.Settings(hf_endpoint=url, ollama_registry=url, **kw)


def requests(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
async def registry(tmp_path):
    reg = build_registry(tmp_path / "reg")
    async with Server(reg.root, log=tmp_path / "requests.jsonl") as server:
        server.registry = reg
        yield server


def store_files(store: Store) -> dict[str, list[str]]:
    return {
        d: sorted(p.name for p in (store.root / d).iterdir()) if (store.root / d).exists() else []
        for d in ("blobs", "snapshots", "partial")
    }


# ------------------------------------------------------------------------------------------ resolve


async def test_every_ollama_form_resolves_to_the_same_manifest(registry):
    s = settings_for(registry.url)
    async with R.session(s) as http:
        got = [
            await R.resolve(ref, s, http)
            for ref in ("tiny:1b", "library/tiny:1b", "ollama:tiny:1b", "ollama:library/tiny:1b")
        ]
    assert {r.reference for r in got} == {"ollama:library/tiny:1b"}
    res = got[0]
    assert (res.format, res.runtime, res.entry) == ("gguf", "llama_server", "model.gguf")
    model = next(b for b in res.blobs if b.role == "weights")
    assert (
        model.digest
        == "sha256:" + __import__("hashlib").sha256((registry.root / "files/tiny.gguf").read_bytes()).hexdigest()
    )
    assert model.url == f"{registry.url}/v2/library/tiny/blobs/{model.digest}"
    assert model.size == (registry.root / "files/tiny.gguf").stat().st_size
    assert {b.name for b in res.blobs} == {"model.gguf", "template", "config.json"}


async def test_hf_gguf_quant_preference_explicit_quant_and_revision(registry):
    s = settings_for(registry.url)
    async with R.session(s) as http:
        default = await R.resolve("hf:acme/tiny-GGUF", s, http)
        q8 = await R.resolve("hf:acme/tiny-GGUF:q8_0", s, http)
        pref = await R.resolve("hf:acme/tiny-GGUF", settings_for(registry.url, quants=("Q8_0", "Q4_K_M")), http)
        pinned = await R.resolve(f"hf:acme/tiny-GGUF@{default.revision}", s, http)
        with pytest.raises(E.BadReference, match="no Q2_K GGUF in this repository; it has Q4_K_M, Q8_0"):
            await R.resolve("hf:acme/tiny-GGUF:Q2_K", s, http)
    assert (default.quant, [b.name for b in default.blobs]) == ("Q4_K_M", ["tiny-Q4_K_M.gguf"])
    assert (q8.quant, pref.quant, pinned.quant) == ("Q8_0", "Q8_0", "Q4_K_M")
    b = default.blobs[0]
    assert b.url == f"{registry.url}/acme/tiny-GGUF/resolve/{default.revision}/tiny-Q4_K_M.gguf"
    assert b.digest.startswith("sha256:") and b.size == (registry.root / "files/q4.gguf").stat().st_size
    assert default.entry == "tiny-Q4_K_M.gguf" and default.runtime == "llama_server"


async def test_hf_digest_comes_from_x_linked_etag_and_a_renamed_repository_is_followed(registry, tmp_path):
    """The file's digest and size come from the HEAD's X-Linked-Etag/X-Linked-Size (the model info's lfs
    block is only a cross-check), the absolute redirect to the CDN is not followed at resolve time, and a
    renamed repository's relative redirects are."""
    import hashlib

    reg = registry.registry
    want = hashlib.sha256((reg.root / "files/q8.gguf").read_bytes()).hexdigest()
    entry = reg.doc["hf"]["acme/tiny-GGUF"]["files"]["tiny-Q8_0.gguf"]
    s = settings_for(registry.url)
    reg.fault("info_sha256", {"tiny-Q8_0.gguf": ""})  # no lfs block: the headers alone must say it
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/old-tiny-GGUF:Q8_0", s, http)
        assert res.blobs[0].digest == f"sha256:{want}" and res.blobs[0].size == entry["size"]
        reg.fault("info_sha256", {"tiny-Q8_0.gguf": "0" * 64})  # the model info disagrees with the headers
        with pytest.raises(E.RegistryError, match="disagrees with itself"):
            await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
    heads = [r for r in requests(tmp_path / "requests.jsonl") if r["method"] == "HEAD"]
    assert heads and not any(r["path"].startswith("/cdn/") for r in heads)  # X-Linked-* read from the 302


async def test_hf_without_gguf_is_a_safetensors_package_for_vllm(registry):
    s = settings_for(registry.url)
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny", s, http)
        with pytest.raises(E.BadReference, match="neither GGUF files nor a safetensors model"):
            await R.resolve("hf:acme/empty", s, http)
    assert (res.format, res.runtime, res.entry) == ("safetensors", "vllm", "")
    names = {b.name: b for b in res.blobs}
    assert set(names) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert names["model.safetensors"].digest.startswith("sha256:")
    assert names["config.json"].digest.startswith("gitsha1:")  # a small file in git: git's blob id


async def test_registry_errors_are_named(registry):
    s = settings_for(registry.url)
    async with R.session(s) as http:
        with pytest.raises(E.NotFound, match="Ollama model library/nope:1b not found"):
            await R.resolve("nope:1b", s, http)
        with pytest.raises(E.NotFound, match="acme/nope"):
            await R.resolve("hf:acme/nope", s, http)
    with pytest.raises(E.BadReference, match="not a model reference"):
        R.refs.parse_reference("Not A Ref!")
    registry.registry.fault("token", "s3cret")
    async with R.session(s) as http:
        with pytest.raises(E.Unauthorized, match="401.*set HF_TOKEN"):
            await R.resolve("hf:acme/tiny", s, http)
        ok = await R.resolve("hf:acme/tiny", settings_for(registry.url, hf_token="s3cret"), http)
    assert ok.format == "safetensors"


def test_haru_resolve_json_and_text(registry_proc):
    url = registry_proc["url"]
    env = {"HF_ENDPOINT": url, "HARU_OLLAMA_REGISTRY": url}
    proc = haru("resolve", "hf:acme/tiny-GGUF", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["quant"] == "Q4_K_M" and doc["format"] == "gguf" and doc["runtime"] == "llama_server"
    assert doc["total_bytes"] == doc["blobs"][0]["size"] > 0
    text = haru("resolve", "tiny:1b", env=env)
    assert text.returncode == 0 and "format gguf -> runtime llama_server" in text.stdout
    bad = haru("resolve", "hf:acme/nope", env=env)
    assert bad.returncode == 3 and "not found (404" in bad.stderr
    usage = haru("resolve", "Not A Ref", env=env)
    assert usage.returncode == 2 and "hf:ORG/REPO[:QUANT][@REVISION]" in usage.stderr
    closed = f"http://127.0.0.1:{lasting_port()}"
    gone = haru("resolve", "tiny:1b", env={"HARU_OLLAMA_REGISTRY": closed})
    assert gone.returncode == 6 and "cannot reach the registry" in gone.stderr


# --------------------------------------------------------------------------------------------- pull


async def test_pull_materializes_verified_files_and_a_second_pull_fetches_nothing(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "home" / "models")
    async with R.session(s) as http:
        res = await R.resolve("tiny:1b", s, http)
        first = await pull(res, store, s, http)
        before = len([r for r in requests(tmp_path / "requests.jsonl") if r["path"].startswith("/cdn/")])
        second = await pull(res, store, s, http)
        after = len([r for r in requests(tmp_path / "requests.jsonl") if r["path"].startswith("/cdn/")])
    assert first.path.name == "model.gguf" and first.path.is_symlink()
    assert first.path.read_bytes() == (registry.root / "files/tiny.gguf").read_bytes()
    assert first.fetched_bytes == res.total_bytes and first.reused_bytes == 0
    assert (second.fetched_bytes, second.reused_bytes, second.path) == (0, res.total_bytes, first.path)
    assert before == after  # nothing went over the network the second time
    assert not os.access(store.blob(res.blobs[0].digest), os.W_OK) or os.geteuid() == 0
    assert store_files(store)["partial"] == [p for p in store_files(store)["partial"] if p.endswith(".lock")]


async def test_pull_safetensors_checks_git_blob_ids_too(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny", s, http)
        got = await pull(res, store, s, http)
    assert got.path.is_dir()
    assert sorted(p.name for p in got.path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((got.path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


async def test_a_same_size_corruption_in_the_store_is_caught_and_healed(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny-GGUF", s, http)
        first = await pull(res, store, s, http)
        blob = store.blob(res.blobs[0].digest)
        os.chmod(blob, 0o644)
        data = bytearray(blob.read_bytes())
        data[4096:4160] = bytes(64)  # 64 bytes zeroed, same size
        blob.write_bytes(bytes(data))
        healed = await pull(res, store, s, http)
    assert healed.healed == [res.blobs[0].digest]
    assert healed.fetched_bytes == res.blobs[0].size
    assert first.path.read_bytes() == (registry.root / "files/q4.gguf").read_bytes()


async def test_wrong_digest_404_401_and_truncated_each_fail_clearly_and_leave_nothing_in_place(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    async with R.session(s) as http:
        res = await R.resolve("tiny:1b", s, http)
        digest = next(b.digest for b in res.blobs if b.role == "weights")
        registry.registry.fault("corrupt", {digest: 1000})
        with pytest.raises(
            E.DigestMismatch,
            match=f"model.gguf: the bytes from 127.0.0.1:\\d+ hash to sha256:.*not the expected {digest}",
        ):
            await pull(res, store, s, http)
        assert not store.blob(digest).exists() and not store.partial(digest).exists()
        registry.registry.clear_faults()
        registry.registry.fault("missing", [digest])
        with pytest.raises(E.NotFound, match="model.gguf .* not found \\(404"):
            await pull(res, store, s, http)
        registry.registry.clear_faults()
        registry.registry.fault("token", "s3cret")  # the registry wants a token it was not given
        with pytest.raises(E.Unauthorized, match="model.gguf .*: 401 from"):
            await pull(res, store, s, http)
        registry.registry.clear_faults()
        registry.registry.fault("truncate", {digest: 5000})
        with pytest.raises(E.Truncated, match="ended the response after 5000 of"):
            await pull(res, store, s, http)
        assert not store.blob(digest).exists()
    assert store_files(store)["snapshots"] == []
    assert not (store.root / "refs").exists() or not any((store.root / "refs").rglob("1b"))


async def test_a_download_cut_mid_body_resumes_with_range_without_refetching(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    log = tmp_path / "requests.jsonl"
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
        b = res.blobs[0]
        registry.registry.fault("short", {b.digest: 200_000})
        with pytest.raises(E.FetchError, match=r"broke off after 200000 of \d+ bytes.*resume from byte 200000"):
            await pull(res, store, s, http)
        assert store.partial(b.digest).stat().st_size == 200_000 and not store.blob(b.digest).exists()
        registry.registry.clear_faults()
        log.write_text("")
        got = await pull(res, store, s, http)
    cdn = [r for r in requests(log) if r["path"].startswith("/cdn/") and "served" in r]
    assert [(r["range"], r["served"]) for r in cdn] == [("bytes=200000-", b.size - 200_000)]
    assert (got.fetched_bytes, got.reused_bytes) == (b.size - 200_000, 200_000)
    assert got.path.read_bytes() == (registry.root / "files/q8.gguf").read_bytes()


async def test_a_corrupt_partial_is_caught_after_resume_and_fetched_again_whole(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
        b = res.blobs[0]
        store.ensure_dirs()
        good = (registry.root / "files/q8.gguf").read_bytes()
        store.partial(b.digest).write_bytes(good[:100] + bytes(64) + good[164:150_000])  # a bad prefix on disk
        got = await pull(res, store, s, http)
    assert got.path.read_bytes() == good


async def test_a_server_that_ignores_range_or_sends_no_length_still_gives_the_whole_verified_file(registry, tmp_path):
    s = settings_for(registry.url)
    good = (registry.root / "files/q8.gguf").read_bytes()
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
        b = res.blobs[0]
        resumed = Store(tmp_path / "resumed")
        resumed.ensure_dirs()
        resumed.partial(b.digest).write_bytes(good[:150_000] + b"x" * 100)  # the 100 bytes would not survive
        registry.registry.fault("ignore_range", [b.digest])
        restarted = await pull(res, resumed, s, http)
        registry.registry.clear_faults()
        registry.registry.fault("chunked", [b.digest])
        chunked = await pull(res, Store(tmp_path / "chunked"), s, http)
    assert restarted.path.read_bytes() == good and (restarted.fetched_bytes, restarted.reused_bytes) == (b.size, 0)
    assert chunked.path.read_bytes() == good and chunked.fetched_bytes == b.size
    cdn = [r for r in requests(tmp_path / "requests.jsonl") if r["path"].startswith("/cdn/") and "served" in r]
    assert [(r["range"], r["served"]) for r in cdn] == [("bytes=150100-", b.size), ("", b.size)]


async def test_a_blob_of_several_write_behind_windows_is_cut_resumed_and_verified(registry, tmp_path):
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(3 * WRITE_BEHIND + 12345))  # the .part is written back and dropped window by window
    registry.registry.add_hf("acme/big-GGUF", {"big-Q4_K_M.gguf": big})
    registry.registry.save()
    cut = WRITE_BEHIND + 4097
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    async with R.session(s) as http:
        res = await R.resolve("hf:acme/big-GGUF", s, http)
        b = res.blobs[0]
        registry.registry.fault("short", {b.digest: cut})
        with pytest.raises(E.FetchError, match=f"broke off after {cut} of {b.size} bytes"):
            await pull(res, store, s, http)
        registry.registry.clear_faults()
        got = await pull(res, store, s, http)
    assert (got.fetched_bytes, got.reused_bytes) == (b.size - cut, cut)
    assert got.path.read_bytes() == big.read_bytes()


async def test_credentials_go_to_the_registry_and_never_to_a_cdn_on_another_origin(registry, tmp_path):
    registry.registry.fault("token", "s3cret")
    cdn_log = tmp_path / "cdn.jsonl"
    async with Server(registry.root, log=cdn_log) as cdn:  # the same files, served from another origin
        registry.registry.cdn(cdn.url)
        s = settings_for(registry.url, hf_token="s3cret")
        store = Store(tmp_path / "models")
        async with R.session(s) as http:
            res = await R.resolve("hf:acme/old-tiny-GGUF:Q8_0", s, http)  # renamed: one more hop on the Hub
            got = await pull(res, store, s, http)
    assert got.path.read_bytes() == (registry.root / "files/q8.gguf").read_bytes()
    hops = [
        (r["path"], r["auth"])
        for r in requests(tmp_path / "requests.jsonl")
        if r["method"] == "GET" and "/resolve/" in r["path"]
    ]
    assert hops == [
        ("/acme/old-tiny-GGUF/resolve/" + res.revision + "/tiny-Q8_0.gguf", True),
        ("/acme/tiny-GGUF/resolve/" + res.revision + "/tiny-Q8_0.gguf", True),
    ]
    assert {(r["path"], r["auth"]) for r in requests(cdn_log)} == {(f"/cdn/{res.blobs[0].digest}", False)}


async def test_a_stalled_download_fails_after_the_read_timeout_and_resumes(registry, tmp_path):
    s = settings_for(registry.url)
    store = Store(tmp_path / "models")
    stalled = aiohttp.ClientTimeout(total=None, connect=5, sock_read=0.5)
    async with aiohttp.ClientSession(timeout=stalled) as http:
        res = await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
        b = res.blobs[0]
        registry.registry.fault("stall", {b.digest: 100_000})
        with pytest.raises(
            E.FetchError,
            match=r"broke off after 100000 of \d+ bytes \(TimeoutError.*resume from byte "
            r"100000",
        ):
            await pull(res, store, s, http)
    registry.registry.clear_faults()
    async with R.session(s) as http:
        got = await pull(res, store, s, http)
    assert (got.fetched_bytes, got.reused_bytes) == (b.size - 100_000, 100_000)
    assert got.path.read_bytes() == (registry.root / "files/q8.gguf").read_bytes()


async def test_a_cancelled_pull_stops_its_threads_and_keeps_the_partial_to_resume(registry, tmp_path):
    log = tmp_path / "slow.jsonl"
    async with Server(registry.root, rate=100_000, log=log) as slow:  # ~600 KB at 100 KB/s: ~6 s
        s = settings_for(slow.url)
        store = Store(tmp_path / "models")
        async with R.session(s) as http:
            res = await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http)
            b = res.blobs[0]
            task = asyncio.create_task(pull(res, store, s, http))
            part = store.partial(b.digest)
            while not (part.exists() and part.stat().st_size > 0):
                assert not task.done(), task
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # the receiver thread returns just after it hands over its result
                if not [t for t in threading.enumerate() if t.name.startswith("haru-pull")]:
                    break
                await asyncio.sleep(0.01)
            assert [t.name for t in threading.enumerate() if t.name.startswith("haru-pull")] == []
            kept = part.stat().st_size
            await asyncio.sleep(0.3)  # at 100 KB/s a writer still running would add ~30 KB
            assert part.stat().st_size == kept and 0 < kept < b.size
    s = settings_for(registry.url)
    async with R.session(s) as http:
        got = await pull(await R.resolve("hf:acme/tiny-GGUF:Q8_0", s, http), store, s, http)
    cdn = [r for r in requests(tmp_path / "requests.jsonl") if r["path"].startswith("/cdn/") and "served" in r]
    assert [(r["range"], r["served"]) for r in cdn] == [(f"bytes={kept}-", b.size - kept)]
    assert (got.fetched_bytes, got.reused_bytes) == (b.size - kept, kept)
    assert got.path.read_bytes() == (registry.root / "files/q8.gguf").read_bytes()


# ------------------------------------------------------------ a server killed mid-download, the CLI


@pytest.fixture
def registry_proc(tmp_path):
    reg = build_registry(tmp_path / "reg")
    port = lasting_port()
    log = tmp_path / "requests.jsonl"
    procs = []

    def start(rate: int = 0):
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.models_registry",
                "--root",
                str(reg.root),
                "--port",
                str(port),
                "--rate",
                str(rate),
                "--log",
                str(log),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    start()
    yield {"url": f"http://127.0.0.1:{port}", "start": start, "procs": procs, "registry": reg, "log": log}
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.timeout(90)
def test_kill_the_registry_mid_download_then_resume(registry_proc, tmp_path):
    url = registry_proc["url"]
    for p in registry_proc["procs"]:
        p.kill()
        p.wait()
    server = registry_proc["start"](rate=150_000)  # ~600 KB at 150 KB/s: about 4 s, time to kill it
    home = tmp_path / "home"
    env = {
        **os.environ,
        "HF_ENDPOINT": url,
        "HARU_OLLAMA_REGISTRY": url,
        "HARU_HOME": str(home),
        "HARU_NO_UVLOOP": "1",
        "HARU_NATS_URL": f"nats://127.0.0.1:{lasting_port()}",
    }
    puller = subprocess.Popen(
        [sys.executable, "-m", "haru.cli", "pull", "tiny:1b"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    partial = home / "models" / "partial"
    deadline = time.monotonic() + 30
    size = 0
    while time.monotonic() < deadline:
        parts = list(partial.glob("*.part")) if partial.exists() else []
        size = max((p.stat().st_size for p in parts), default=0)
        if size >= 150_000:
            break
        time.sleep(0.02)
    assert size >= 150_000, "the pull never got going"
    server.send_signal(signal.SIGKILL)
    server.wait()
    out, err = puller.communicate(timeout=30)
    assert puller.returncode == 1, (out, err)
    assert "broke off after" in err and "run the same pull again to resume" in err
    kept = max(p.stat().st_size for p in partial.glob("*.part"))
    assert kept >= size
    assert not list((home / "models" / "snapshots").iterdir())
    registry_proc["log"].write_text("")
    registry_proc["start"]()
    done = haru(
        "pull",
        "tiny:1b",
        env={k: env[k] for k in ("HF_ENDPOINT", "HARU_OLLAMA_REGISTRY", "HARU_HOME", "HARU_NATS_URL")},
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.read_bytes() == (registry_proc["registry"].root / "files/tiny.gguf").read_bytes()
    cdn = [r for r in requests(registry_proc["log"]) if r["path"].startswith("/cdn/") and "served" in r]
    model = [r for r in cdn if r["range"]]
    assert len(model) == 1 and model[0]["range"] == f"bytes={kept}-"
    assert model[0]["served"] == path.stat().st_size - kept  # only what was missing
    assert "not recorded in the event log" in done.stderr


def test_pull_records_a_fetch_event_that_why_and_verify_cover(registry_proc, nats_server, tmp_path):
    url = registry_proc["url"]
    env = {"HF_ENDPOINT": url, "HARU_OLLAMA_REGISTRY": url, "HARU_HOME": str(tmp_path / "home")}
    asyncio.run(_ensure(nats_server.url))
    done = haru("pull", "hf:acme/tiny-GGUF", "--json", nats_url=nats_server.url, env=env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["recorded"].startswith("seq ") and doc["fetched_bytes"] > 0
    why = haru("why", "hf:acme/tiny-GGUF", nats_url=nats_server.url)
    assert why.returncode == 0, why.stderr
    assert "fetched" in why.stdout and "tiny-Q4_K_M.gguf" in why.stdout and url in why.stdout
    verify = haru("verify", nats_url=nats_server.url)
    assert verify.returncode == 0 and "history intact" in verify.stdout


async def _ensure(url: str) -> None:
    from haru.log.eventlog import EventLog

    async with EventLog.connect([url], writer="test") as log:
        await log.ensure()
