"""The lazy filesystem the power-loss tests stand on (tests/support/lazyfs.py), tested on its own:
a write without fsync is gone after a power loss, one after fsync is kept, names follow the same rule,
and the file faults change exactly what they say. Needs FUSE: skipped without it, failed in CI
(HARU_REQUIRE_FUSE=1)."""

from __future__ import annotations

import os

import pytest

from tests.support.lazyfs import LazyFS, LazyFSError, require_fuse


@pytest.fixture
def lazy(tmp_path):
    require_fuse()
    with LazyFS(tmp_path / "mnt") as fs:
        yield fs


def write(path, data: bytes, *, sync: bool) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def test_a_write_without_fsync_is_gone_after_a_power_loss_and_one_after_fsync_is_kept(lazy):
    m = lazy.mountpoint
    write(m / "log", b"kept;", sync=True)
    write(m / "log", b"forgotten", sync=False)
    assert (m / "log").read_bytes() == b"kept;forgotten"  # before the power goes, reads see everything

    lost = lazy.power_loss()

    assert (m / "log").read_bytes() == b"kept;"
    assert lost["bytes"] == len(b"forgotten")


def test_an_overwrite_in_place_without_fsync_is_undone(lazy):
    m = lazy.mountpoint
    write(m / "f", b"aaaa", sync=True)
    with open(m / "f", "r+b") as f:
        f.seek(1)
        f.write(b"ZZ")
    assert (m / "f").read_bytes() == b"aZZa"
    lazy.power_loss()
    assert (m / "f").read_bytes() == b"aaaa"


def test_a_new_name_is_gone_unless_something_was_fsynced_after_it(lazy):
    m = lazy.mountpoint
    os.mkdir(m / "dir")
    write(m / "dir" / "never-synced", b"x", sync=False)
    assert sorted(os.listdir(m)) == ["dir"]

    lazy.power_loss()

    assert os.listdir(m) == []


def test_fsyncing_a_file_keeps_its_name_and_data_and_other_names_but_not_their_data(lazy):
    m = lazy.mountpoint
    write(m / "other", b"unsynced data", sync=False)
    write(m / "synced", b"data", sync=True)  # commits every name made so far, as a journal would

    lazy.power_loss()

    assert sorted(os.listdir(m)) == ["other", "synced"]
    assert (m / "synced").read_bytes() == b"data"
    assert (m / "other").read_bytes() == b""  # its name survived, its data was never synced


def test_fsyncing_a_directory_keeps_names_and_an_unsynced_rename_or_unlink_is_undone(lazy):
    m = lazy.mountpoint
    write(m / "a", b"A", sync=True)
    write(m / "b", b"B", sync=True)
    fd = os.open(m, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(m / "a", m / "renamed")
    os.unlink(m / "b")
    assert sorted(os.listdir(m)) == ["renamed"]

    lazy.power_loss()

    assert sorted(os.listdir(m)) == ["a", "b"]
    assert (m / "a").read_bytes() == b"A"


def test_writeback_makes_everything_durable_as_the_kernel_flusher_does(lazy):
    m = lazy.mountpoint
    write(m / "f", b"old enough", sync=False)
    assert lazy.unsynced()["files"] == ["/f"]
    lazy.writeback()
    assert lazy.unsynced() == {"bytes": 0, "files": [], "names": False}
    lazy.power_loss()
    assert (m / "f").read_bytes() == b"old enough"


def test_flipped_bits_and_a_truncation_are_the_disk_s_and_survive_a_power_loss(lazy):
    m = lazy.mountpoint
    original = bytes(range(256)) * 4
    write(m / "blk", original, sync=True)

    flipped = lazy.flip_bits("blk", count=3, seed=7)["flipped"]
    damaged = (m / "blk").read_bytes()
    assert len(damaged) == len(original)
    expected = bytearray(original)
    for offset, bit in flipped:
        expected[offset] ^= bit
    assert damaged == bytes(expected) != original
    lazy.power_loss()
    assert (m / "blk").read_bytes() == damaged  # a disk fault is durable

    assert lazy.truncate("blk", 100) == {"was": len(original), "size": 100}
    lazy.power_loss()
    assert (m / "blk").read_bytes() == damaged[:100]


def test_a_bad_command_names_the_problem(lazy):
    with pytest.raises(LazyFSError, match="missing"):
        lazy.flip_bits("missing", count=1)
