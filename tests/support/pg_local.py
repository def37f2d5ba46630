"""A throwaway PostgreSQL from the machine's binaries, for tests, benchmarks and demos.

    with LocalPostgres() as pg:          # initdb into a temporary directory, pg_ctl start
        pg.dsn("postgres")               # postgresql://postgres@127.0.0.1:<port>/postgres

Loopback only (listen_addresses=127.0.0.1, a free port, the unix socket inside the directory),
trust authentication, durability off unless `durable=True`. The binaries are found through
`$HARU_PG_BINDIR`, PATH, `/usr/lib/postgresql/<version>/bin` (the newest) or `pg_config --bindir`.
PostgreSQL refuses to run as root: when we are root the cluster is owned by, and run as, an
unprivileged user (`$HARU_PG_USER`, else `nobody`) through `runuser` (or, without util-linux, by
dropping privileges in the child), in a directory that user can reach.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from haru.core.errors import ConfigError
from tests.support.ports import lasting_port

_TOOLS = ("initdb", "pg_ctl", "postgres")


def find_bindir() -> str | None:
    """The directory holding initdb, pg_ctl and postgres, or None when there is none."""

    def complete(d: str | os.PathLike[str]) -> bool:
        return all(os.access(os.path.join(d, t), os.X_OK) for t in _TOOLS)

    explicit = os.environ.get("HARU_PG_BINDIR")
    if explicit:
        return explicit if complete(explicit) else None
    initdb = shutil.which("initdb")
    if initdb:
        d = os.path.dirname(os.path.realpath(initdb))
        if complete(d):
            return d
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    for d in candidates:
        if complete(d):
            return d
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            d = out.stdout.strip()
            if out.returncode == 0 and d and complete(d):
                return d
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parent.name
    return tuple(int(p) for p in version.split(".") if p.isdigit()) or (0,)


def _traversable_tmp() -> str:
    """A temporary directory base that an unprivileged user can reach: $TMPDIR when every
    ancestor is world-searchable, else /tmp (pytest's and some CI's TMPDIRs are root-only)."""
    base = Path(tempfile.gettempdir()).resolve()
    for d in (base, *base.parents):
        if not os.stat(d).st_mode & 0o001:
            return "/tmp"
    return str(base)


class LocalPostgres:
    """One PostgreSQL cluster in a temporary directory, started with pg_ctl."""

    def __init__(
        self,
        *,
        bindir: str | None = None,
        port: int = 0,
        durable: bool = False,
        settings: dict[str, str] | None = None,
    ) -> None:
        found = bindir or find_bindir()
        if not found:
            raise ConfigError(
                "PostgreSQL binaries (initdb, pg_ctl, postgres) not found: install them "
                "(apt-get install postgresql) or set HARU_PG_BINDIR to their directory"
            )
        self.bindir = found
        self.port = port or lasting_port()
        self.durable = durable
        self.settings = settings or {}
        self.root: Path | None = None
        self.user: str | None = None
        self.started = False

    @property
    def data(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.root is not None
        return self.root / "sock"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, argv: list[str], timeout: float) -> None:
        kwargs: dict = {}
        if self.user is not None:
            if shutil.which("runuser"):
                argv = ["runuser", "-u", self.user, "--", *argv]
            else:  # no util-linux: drop privileges in the child directly
                entry = pwd.getpwnam(self.user)
                kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
        if out.returncode != 0:
            log = self.root / "postgres.log" if self.root else None
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise ConfigError(
                f"{Path(argv[0]).name} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}\n{tail}"
            )

    def start(self) -> LocalPostgres:
        as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="haru-pg-", dir=_traversable_tmp() if as_root else None))
        if as_root:
            self.user = os.environ.get("HARU_PG_USER", "nobody")
            try:
                entry = pwd.getpwnam(self.user)
            except KeyError as exc:
                raise ConfigError(
                    f"PostgreSQL will not run as root and user {self.user!r} does not exist: "
                    f"create it (useradd -r {self.user}) or set HARU_PG_USER to an unprivileged user"
                ) from exc
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        os.chmod(self.root, 0o700)
        self._run(
            [
                os.path.join(self.bindir, "initdb"),
                "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                "--locale=C", "--no-sync", "--no-instructions",
            ],
            timeout=120,
        )  # fmt: skip
        self._as_owner(self.socket_dir.mkdir)
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": "50",
            "shared_buffers": "128MB",
            "timezone": "UTC",
        }
        if not self.durable:
            options |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        options |= self.settings
        self._options = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._launch()
        return self

    def _launch(self) -> None:
        assert self.root is not None, "start() makes the cluster's directory first"
        self._run(
            [
                os.path.join(self.bindir, "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"),
                "-o", self._options, "-w", "-t", "60", "start",
            ],
            timeout=90,
        )  # fmt: skip
        self.started = True

    def _shutdown(self, mode: str = "fast") -> None:
        pg_ctl = os.path.join(self.bindir, "pg_ctl")
        try:
            self._run([pg_ctl, "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop"], timeout=45)
        except (ConfigError, subprocess.TimeoutExpired):
            self._run([pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"], timeout=30)
        self.started = False

    def restart(self, *, mode: str = "fast", down_for: float = 0.0) -> None:
        """Stop the server (`fast` disconnects every client, `immediate` is a crash) and start it again."""
        self._shutdown(mode)
        if down_for:
            import time

            time.sleep(down_for)
        self._launch()

    def _as_owner(self, make) -> None:
        make()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.socket_dir, entry.pw_uid, entry.pw_gid)

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            if self.started:
                self._shutdown("fast")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> LocalPostgres:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
