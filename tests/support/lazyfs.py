"""A lazy filesystem for fault tests: a FUSE mount that forgets what was never fsynced.

    with LazyFS(tmp_path / "store") as fs:      # mounts (a child process); unmounts on the way out
        ... nats-server writes its store under fs.mountpoint ...
        server.kill()                           # the machine loses power: the process dies first,
        lost = fs.power_loss()                  # then the page cache: unsynced writes are gone
        fs.flip_bits("jetstream/.../1.blk", count=8, seed=1)
        fs.truncate("jetstream/.../1.blk", 100)

Everything lives in the child's memory (a store for a test is small). Each file has what is
*current* (what reads see) and what is *durable* (what a disk would still hold after a power cut):

- file data becomes durable when that file is fsynced (fsync/fdatasync on any of its handles);
- names (create, mkdir, unlink, rename, truncation of the namespace) become durable at the next
  fsync of anything, file or directory: like a journalling filesystem (ext4, xfs), whose fsync
  commits the one metadata journal with every name change made before it;
- `power_loss()` puts back the durable state: unsynced data and unsynced names vanish, a file whose
  name survived but whose data was never synced comes back empty;
- `writeback()` makes everything durable, as the kernel's flusher does with pages dirty for ~30 s:
  a test calls it to say "long enough ago" (nats-server writes a stream's meta.inf/meta.sum without
  an fsync, even with `sync_interval: always`; a real disk has them once the flusher ran).

File faults are disk faults, so they change both what is current and what is durable:
`flip_bits(path, count, seed)` flips `count` bits at seeded random offsets, `truncate(path, n)` cuts
a file to n bytes. Both name the offsets and lengths they touched.

The kernel is told to cache nothing (direct I/O, zero attribute and entry timeouts), so after a
power loss every read sees the filesystem's new state at once. The mount runs as a child process
(`python -m tests.support.lazyfs MOUNTPOINT`) controlled by JSON lines on its stdin/stdout, so a
test mounts and unmounts it like any other child. It needs /dev/fuse, fusermount3 (Debian's
`fuse3`, with `libfuse3-3`) and mfusepy; `require_fuse()` skips a test without them, or fails it
when HARU_REQUIRE_FUSE=1 (CI).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def fuse_missing() -> str | None:
    """Why a lazy filesystem cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not found: apt-get install fuse3 libfuse3-3"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libfuse itself is missing
        return f"mfusepy unusable ({exc}): pip install -e '.[test]' and apt-get install fuse3 libfuse3-3"
    return None


def require_fuse() -> None:
    """Skip the calling test when FUSE is unusable here; fail it instead when HARU_REQUIRE_FUSE=1 (CI)."""
    import pytest

    reason = fuse_missing()
    if reason is None:
        return
    if os.environ.get("HARU_REQUIRE_FUSE") == "1":
        pytest.fail(reason + " [HARU_REQUIRE_FUSE=1]")
    pytest.skip(reason)


class LazyFSError(RuntimeError):
    """The lazy filesystem refused a command or its child died."""


class LazyFS:
    """The parent's handle: mounts the child, sends it commands, unmounts it."""

    def __init__(self, mountpoint: str | os.PathLike[str], *, mount_timeout: float = 15.0) -> None:
        self.mountpoint = Path(mountpoint)
        self.mount_timeout = mount_timeout
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def mount(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.lazyfs", str(self.mountpoint)],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.mount_timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise LazyFSError(f"lazyfs exited with {self.proc.returncode} before mounting: {err.strip()}")
            if time.monotonic() > deadline:
                self.unmount()
                raise LazyFSError(f"lazyfs did not mount {self.mountpoint} within {self.mount_timeout:.0f}s")
            time.sleep(0.02)

    def unmount(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False)
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()

    def command(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            proc = self.proc
            if proc is None or proc.stdin is None or proc.stdout is None:
                raise LazyFSError("lazyfs is not mounted")
            proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise LazyFSError(f"lazyfs died during {op!r} (exit {proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise LazyFSError(f"lazyfs {op}: {reply['error']}")
        return reply

    def power_loss(self) -> dict[str, Any]:
        """Forget every write and name change not yet fsynced. Returns what was forgotten:
        `bytes` of unsynced data dropped, `paths` that vanished."""
        return self.command("drop")

    def flip_bits(self, path: str, *, count: int = 1, seed: int = 0) -> dict[str, Any]:
        """Flip `count` bits of the file at `path` (relative to the mount) at seeded random offsets."""
        return self.command("flip", path=path, count=count, seed=seed)

    def truncate(self, path: str, length: int) -> dict[str, Any]:
        """Cut the file at `path` (relative to the mount) to `length` bytes, durably."""
        return self.command("truncate", path=path, length=length)

    def unsynced(self) -> dict[str, Any]:
        """How much a power loss would forget now, without forgetting it."""
        return self.command("unsynced")

    def writeback(self) -> dict[str, Any]:
        """Make everything durable now, as the kernel's flusher does with dirty pages older than
        ~30 s (vm.dirty_expire_centisecs) whether or not anyone fsyncs: a power loss long after a
        write does not lose it. Returns what was written back."""
        return self.command("writeback")

    def __enter__(self) -> LazyFS:
        self.mount()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()


# --- the child: the filesystem itself -----------------------------------------------------------


@dataclass
class Node:
    mode: int
    data: bytearray = field(default_factory=bytearray)
    durable: bytearray = field(default_factory=bytearray)
    dirty: list[tuple[int, int]] = field(default_factory=list)  # written ranges not yet fsynced
    resized: bool = False  # the length changed since the last fsync
    entries: dict[str, int] = field(default_factory=dict)  # directories: name -> inode
    times: tuple[int, int] = (0, 0)  # atime, mtime (ns)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class Lazy:
    """The in-memory state and its rules; every operation holds one lock."""

    ROOT = 1

    def __init__(self) -> None:
        now = time.time_ns()
        self.nodes: dict[int, Node] = {self.ROOT: Node(stat.S_IFDIR | 0o755, times=(now, now))}
        self.next_ino = 2
        self.durable_names: dict[int, dict[str, int]] = {self.ROOT: {}}
        self.names_dirty = False
        self.handles: dict[int, int] = {}
        self.next_fh = 1
        self.lock = threading.RLock()

    # paths
    def lookup(self, path: str) -> int:
        ino = self.ROOT
        for part in [p for p in path.split("/") if p]:
            node = self.nodes[ino]
            if not node.is_dir:
                raise OSError(errno.ENOTDIR, path)
            if part not in node.entries:
                raise OSError(errno.ENOENT, path)
            ino = node.entries[part]
        return ino

    def parent(self, path: str) -> tuple[Node, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        node = self.nodes[self.lookup(head or "/")]
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, path)
        return node, name

    def new(self, mode: int) -> int:
        ino = self.next_ino
        self.next_ino += 1
        now = time.time_ns()
        self.nodes[ino] = Node(mode, times=(now, now))
        return ino

    # durability
    def sync_file(self, ino: int) -> None:
        node = self.nodes.get(ino)
        if node is not None and not node.is_dir and (node.dirty or node.resized):
            if len(node.durable) != len(node.data):
                del node.durable[len(node.data) :]
                node.durable.extend(b"\0" * (len(node.data) - len(node.durable)))
            for start, end in node.dirty:
                end = min(end, len(node.data))
                if start < end:
                    node.durable[start:end] = node.data[start:end]
            node.dirty.clear()
            node.resized = False
        self.sync_names()

    def sync_names(self) -> None:
        if self.names_dirty:
            self.durable_names = {ino: dict(n.entries) for ino, n in self.nodes.items() if n.is_dir}
            self.names_dirty = False

    def unsynced(self) -> dict[str, Any]:
        """What a power loss would forget: bytes of data, the paths holding them, and whether names would."""
        pending = sum(sum(e - s for s, e in n.dirty) for n in self.nodes.values())
        inos = {ino for ino, n in self.nodes.items() if n.dirty or n.resized}
        files = [p for p in self.paths() if self._ino_of(p) in inos]
        return {"bytes": pending, "files": files, "names": self.names_dirty}

    def _ino_of(self, path: str) -> int | None:
        try:
            return self.lookup(path)
        except OSError:
            return None

    def drop(self) -> dict[str, Any]:
        """Power loss: the durable names and data become the whole truth."""
        before = set(self.paths())
        dropped = self.unsynced()["bytes"]
        live: set[int] = set()
        stack = [self.ROOT]
        while stack:
            ino = stack.pop()
            live.add(ino)
            node = self.nodes[ino]
            if node.is_dir:
                node.entries = dict(self.durable_names.get(ino, {}))
                stack.extend(node.entries.values())
        for ino in list(self.nodes):
            if ino not in live:
                del self.nodes[ino]
        for node in self.nodes.values():
            if not node.is_dir:
                node.data = bytearray(node.durable)
                node.dirty.clear()
                node.resized = False
        self.handles.clear()  # the processes that held them died with the power
        self.names_dirty = False
        after = set(self.paths())
        return {"bytes": dropped, "paths": sorted(before - after)}

    def paths(self, ino: int = 1, prefix: str = "") -> list[str]:
        out = []
        for name, child in self.nodes[ino].entries.items():
            path = f"{prefix}/{name}"
            out.append(path)
            if self.nodes[child].is_dir:
                out.extend(self.paths(child, path))
        return out

    # file faults (the disk's, so current and durable alike)
    def flip(self, path: str, count: int, seed: int) -> dict[str, Any]:
        node = self.nodes[self.lookup(path)]
        if node.is_dir or not node.data:
            raise OSError(errno.EINVAL, f"{path} is a directory or empty")
        rng = random.Random(seed)
        flipped = []
        for _ in range(count):
            offset = rng.randrange(len(node.data))
            bit = 1 << rng.randrange(8)
            node.data[offset] ^= bit
            if offset < len(node.durable):
                node.durable[offset] ^= bit
            flipped.append([offset, bit])
        return {"flipped": flipped, "size": len(node.data)}

    def cut(self, path: str, length: int) -> dict[str, Any]:
        node = self.nodes[self.lookup(path)]
        if node.is_dir:
            raise OSError(errno.EISDIR, path)
        was = len(node.data)
        del node.data[length:]
        del node.durable[length:]
        return {"was": was, "size": len(node.data)}


def _operations(lazy: Lazy) -> Any:
    import mfusepy

    def fail(code: int) -> mfusepy.FuseOSError:
        return mfusepy.FuseOSError(code)

    class Operations(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.lazy = lazy

        def _ino(self, path: str, fh: int | None = None) -> int:
            if fh and fh in lazy.handles:
                return lazy.handles[fh]
            try:
                return lazy.lookup(path)
            except OSError as exc:
                raise fail(exc.errno or errno.EIO) from None

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            with lazy.lock:
                ino = self._ino(path, fh)
                node = lazy.nodes[ino]
                size = len(node.data)
                return {
                    "st_mode": node.mode,
                    "st_ino": ino,
                    "st_nlink": 2 if node.is_dir else 1,
                    "st_size": size,
                    "st_blocks": (size + 511) // 512,
                    "st_atime": node.times[0],
                    "st_mtime": node.times[1],
                    "st_ctime": node.times[1],
                    "st_uid": os.getuid(),
                    "st_gid": os.getgid(),
                }

        def readdir(self, path: str, fh: int) -> list[str]:
            with lazy.lock:
                node = lazy.nodes[self._ino(path)]
                return [".", "..", *node.entries]

        def _create(self, path: str, mode: int) -> int:
            parent, name = lazy.parent(path)
            if name in parent.entries:
                raise fail(errno.EEXIST)
            ino = lazy.new(mode)
            parent.entries[name] = ino
            lazy.names_dirty = True
            return ino

        def mkdir(self, path: str, mode: int) -> int:
            with lazy.lock:
                self._create(path, stat.S_IFDIR | (mode & 0o7777))
                return 0

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            with lazy.lock:
                ino = self._create(path, stat.S_IFREG | (mode & 0o7777))
                fh = lazy.next_fh
                lazy.next_fh += 1
                lazy.handles[fh] = ino
                return fh

        def open(self, path: str, flags: int) -> int:
            with lazy.lock:
                ino = self._ino(path)
                node = lazy.nodes[ino]
                if flags & os.O_TRUNC and node.data:
                    node.data.clear()
                    node.resized = True
                fh = lazy.next_fh
                lazy.next_fh += 1
                lazy.handles[fh] = ino
                return fh

        def release(self, path: str, fh: int) -> int:
            with lazy.lock:
                lazy.handles.pop(fh, None)
                return 0

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            with lazy.lock:
                node = lazy.nodes[self._ino(path, fh)]
                return bytes(node.data[offset : offset + size])

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            with lazy.lock:
                node = lazy.nodes[self._ino(path, fh)]
                end = offset + len(data)
                if offset > len(node.data):
                    node.data.extend(b"\0" * (offset - len(node.data)))
                if end > len(node.data):
                    node.resized = True
                node.data[offset:end] = data
                node.dirty.append((offset, end))
                if len(node.dirty) > 256:  # keep the range list short: merge into one span
                    node.dirty = [(min(s for s, _ in node.dirty), max(e for _, e in node.dirty))]
                node.times = (node.times[0], time.time_ns())
                return len(data)

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            with lazy.lock:
                node = lazy.nodes[self._ino(path, fh)]
                if length < len(node.data):
                    del node.data[length:]
                else:
                    node.data.extend(b"\0" * (length - len(node.data)))
                node.resized = True
                return 0

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
            with lazy.lock:
                node = lazy.nodes[self._ino(path, fh)]
                if mode == 0 and offset + size > len(node.data):
                    node.data.extend(b"\0" * (offset + size - len(node.data)))
                    node.resized = True
                return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            with lazy.lock:
                lazy.sync_file(self._ino(path, fh))
                return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            with lazy.lock:
                lazy.sync_names()
                return 0

        def flush(self, path: str, fh: int) -> int:
            return 0  # close() writes nothing durable: only fsync does

        def unlink(self, path: str) -> int:
            with lazy.lock:
                parent, name = lazy.parent(path)
                ino = parent.entries.get(name)
                if ino is None:
                    raise fail(errno.ENOENT)
                if lazy.nodes[ino].is_dir:
                    raise fail(errno.EISDIR)
                del parent.entries[name]
                lazy.names_dirty = True
                return 0

        def rmdir(self, path: str) -> int:
            with lazy.lock:
                parent, name = lazy.parent(path)
                ino = parent.entries.get(name)
                if ino is None:
                    raise fail(errno.ENOENT)
                if lazy.nodes[ino].entries:
                    raise fail(errno.ENOTEMPTY)
                del parent.entries[name]
                lazy.names_dirty = True
                return 0

        def rename(self, old: str, new: str) -> int:
            with lazy.lock:
                src, src_name = lazy.parent(old)
                dst, dst_name = lazy.parent(new)
                ino = src.entries.get(src_name)
                if ino is None:
                    raise fail(errno.ENOENT)
                target = dst.entries.get(dst_name)
                if target is not None and lazy.nodes[target].is_dir and lazy.nodes[target].entries:
                    raise fail(errno.ENOTEMPTY)
                del src.entries[src_name]
                dst.entries[dst_name] = ino
                lazy.names_dirty = True
                return 0

        def chmod(self, path: str, mode: int) -> int:
            with lazy.lock:
                node = lazy.nodes[self._ino(path)]
                node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
                return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            with lazy.lock:
                node = lazy.nodes[self._ino(path)]
                node.times = times or (time.time_ns(), time.time_ns())
                return 0

        def statfs(self, path: str) -> dict[str, int]:
            blocks = 64 * 1024 * 1024 * 1024 // 4096  # 64 GiB, all free: the store is small
            return {
                "f_bsize": 4096,
                "f_frsize": 4096,
                "f_blocks": blocks,
                "f_bfree": blocks,
                "f_bavail": blocks,
                "f_files": 1 << 20,
                "f_ffree": 1 << 20,
                "f_namemax": 255,
            }

    return Operations()


def _serve_commands(lazy: Lazy) -> None:
    """The control channel: one JSON command a line on stdin, one JSON reply a line on stdout."""
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            with lazy.lock:
                if op == "drop":
                    reply = lazy.drop()
                elif op == "flip":
                    reply = lazy.flip(cmd["path"], int(cmd["count"]), int(cmd["seed"]))
                elif op == "truncate":
                    reply = lazy.cut(cmd["path"], int(cmd["length"]))
                elif op == "unsynced":
                    reply = lazy.unsynced()
                elif op == "writeback":
                    reply = lazy.unsynced()
                    for ino in list(lazy.nodes):
                        lazy.sync_file(ino)
                    lazy.sync_names()
                else:
                    reply = {"error": f"unknown command {op!r}: drop, flip, truncate, unsynced or writeback"}
        except (OSError, KeyError, ValueError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    import mfusepy

    mountpoint = argv[0]
    lazy = Lazy()
    threading.Thread(target=_serve_commands, args=(lazy,), daemon=True).start()
    mfusepy.FUSE(
        _operations(lazy),
        mountpoint,
        foreground=True,
        nothreads=False,
        direct_io=True,
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
        default_permissions=True,
        allow_other=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
