"""`haru pull` throughput vs `curl` of the same blob from the same local registry, in the same run.

    python bench/pull.py [--mib 256] [--rounds 5]

A registry on 127.0.0.1 (tests/support/models_registry.py, a separate process) serves one random blob of
--mib MiB as a Hugging Face LFS file. Each round, alternating: `curl -sSL -o FILE URL` of the blob's
URL, and a pull (resolve + fetch + sha256 + fsync + rename + materialize) into an empty store. The pull
includes its verification; curl does none (sha256 of the same bytes afterwards is printed apart, to
show what verification costs). Prints the medians and the ratio curl_s / pull_s (goal ≥ 0.8x), and
the same for the fetch alone (resolution is two small requests, ~0.15 s against this local server).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from haru.host.natsd import free_port
from haru.models import resolve as R
from haru.models.pull import pull
from haru.models.store import Store
from tests.support.models_registry import Registry


async def one_pull(url: str, root: Path) -> tuple[float, float]:
    """(whole pull incl. resolution, the fetch alone: fetch + sha256 + fsync + rename + materialize)."""
    s = R.Settings(hf_endpoint=url, ollama_registry=url)
    started = time.perf_counter()
    async with R.session(s) as http:
        res = await R.resolve("hf:bench/blob", s, http)
        fetch_started = time.perf_counter()
        await pull(res, Store(root), s, http)
    done = time.perf_counter()
    return done - started, done - fetch_started


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if shutil.which("curl") is None:
        print("curl is not installed: nothing to compare with", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="haru-bench-pull-") as tmp:
        tmp = Path(tmp)
        blob = tmp / "files" / "blob.gguf"
        blob.parent.mkdir()
        with open(blob, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        reg = Registry(tmp / "reg")
        reg.add_hf("bench/blob", {"blob-Q4_K_M.gguf": blob})
        reg.save()
        digest = hashlib.sha256(blob.read_bytes()).hexdigest()
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.support.models_registry", "--root", str(reg.root), "--port", str(port)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            url = f"http://127.0.0.1:{port}"
            cdn = f"{url}/cdn/sha256:{digest}"
            curl_s, pull_s, fetch_s, hash_s = [], [], [], []
            for r in range(args.rounds):
                out = tmp / f"curl-{r}"
                t0 = time.perf_counter()
                subprocess.run(["curl", "-sSL", "-o", str(out), cdn], check=True)
                curl_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert hashlib.file_digest(open(out, "rb"), "sha256").hexdigest() == digest
                hash_s.append(time.perf_counter() - t0)
                out.unlink()
                whole, fetch = asyncio.run(one_pull(url, tmp / f"store-{r}"))
                pull_s.append(whole)
                fetch_s.append(fetch)
                shutil.rmtree(tmp / f"store-{r}")
        finally:
            server.kill()
            server.wait()
    c, pl, h = statistics.median(curl_s), statistics.median(pull_s), statistics.median(hash_s)
    fe = statistics.median(fetch_s)
    mib = args.mib
    print(f"blob {mib} MiB, {args.rounds} rounds, medians")
    print(f"  curl (no verification)        {c:7.3f} s  {mib / c:8.1f} MiB/s")
    print(f"  sha256 of curl's file, apart  {h:7.3f} s")
    print(f"  haru pull (verified, atomic)  {pl:7.3f} s  {mib / pl:8.1f} MiB/s")
    print(f"  of which the fetch (no resolve) {fe:5.3f} s  {mib / fe:8.1f} MiB/s")
    print(f"  ratio curl_s / pull_s         {c / pl:7.2f}x  (goal >= 0.8x)")
    print(f"  ratio curl_s / fetch_s        {c / fe:7.2f}x")
    print(f"  each round, curl: {' '.join(f'{x:.3f}' for x in curl_s)}")
    print(f"  each round, pull: {' '.join(f'{x:.3f}' for x in pull_s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
