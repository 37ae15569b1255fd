"""The one implementation of "is that process gone" and of kept shared-memory segments (asyncflow_core.processes,
asyncflow_core.kept_segments), which the rank hand-over, the ``shm`` weight transport and the store servers share.

The lock checks use a second open of the segment file (a reader's descriptor
of its own), as another process would: ``flock`` locks belong to the open
file, so two opens in one process contend like two processes do.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncflow_core import kept_segments, processes
from asyncflow_core.kept_segments import KeptSegment, SegmentKeeper, check_shm_room, map_shared
from asyncflow_core.processes import pid_alive, sweep_dead


def _reaped_pid() -> int:
    """A pid that no longer exists (its process ended and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- pid_alive


def test_pid_alive_this_process_and_not_a_reaped_one():
    assert pid_alive(os.getpid())
    assert not pid_alive(_reaped_pid())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="zombies are told apart through Linux /proc")
def test_a_zombie_is_gone():
    """Ended but not reaped: it holds no file, mapping or lock any more, so its leftovers may go."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # wait for the end, leave it unreaped
        assert Path(f"/proc/{proc.pid}").exists()  # still in the process table
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()


def test_another_users_process_is_alive(monkeypatch):
    """EPERM: the process exists; judging it gone could remove a live process's files."""

    def eperm(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(processes.os, "kill", eperm)
    assert pid_alive(12345)


@pytest.mark.parametrize("pid", [0, -1, 2**40])
def test_no_single_process_is_not_alive(pid):
    assert not pid_alive(pid)  # kill(0, 0) would ask about this process group, kill(-1, 0) about every process


# ---------------------------------------------------------------- sweep_dead


def test_sweep_removes_only_this_users_leftovers_of_gone_processes(tmp_path):
    dead, me = _reaped_pid(), os.getpid()
    pattern = re.compile(r"^left-(\d+)-")
    (tmp_path / f"left-{dead}-file").write_bytes(b"x")
    (tmp_path / f"left-{me}-file").write_bytes(b"x")  # a live process's
    (tmp_path / f"left-{dead}-dir").mkdir()
    (tmp_path / f"left-{dead}-dir" / "inside").write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    (tmp_path / f"left-{dead}-link").symlink_to(tmp_path / "other-file")
    assert sweep_dead(tmp_path, pattern) == [str(tmp_path / f"left-{dead}-file")]
    assert sweep_dead(tmp_path, pattern, directories=True) == [str(tmp_path / f"left-{dead}-dir")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"left-{me}-file", "other-file", f"left-{dead}-link"])
    assert sweep_dead(tmp_path / "missing", pattern) == []


def test_sweep_leaves_another_users_files(tmp_path, monkeypatch):
    dead = _reaped_pid()
    (tmp_path / f"left-{dead}-file").write_bytes(b"x")
    monkeypatch.setattr(processes.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert sweep_dead(tmp_path, re.compile(r"^left-(\d+)-")) == []
    assert (tmp_path / f"left-{dead}-file").exists()


# ---------------------------------------------------------------- kept segments


def _reader(segment: KeptSegment) -> int:
    return os.open(segment.path, os.O_RDONLY)


def test_a_reader_maps_only_after_the_writer_unlocks_and_its_mapping_keeps_the_writer_out(tmp_path):
    keeper = SegmentKeeper(tmp_path, "seg-")
    try:
        segment = keeper.create(4096)
        assert segment.path.name.startswith(f"seg-{os.getpid()}-{keeper.token}-")
        fd = _reader(segment)
        try:
            assert map_shared(fd, 4096, writable=False) is None  # created holding the exclusive lock
            segment.view.fill_(7)
            segment.unlock()
            mapped = map_shared(fd, 4096, writable=False)
        finally:
            os.close(fd)  # the mapping keeps a duplicate descriptor, and with it the shared lock
        assert mapped is not None and mapped[0] == 7
        assert not segment.try_lock()  # a reader maps it: never rewritten
        mapped.close()
        assert segment.try_lock()  # the lock went with the mapping
        assert segment.try_lock()  # taking it again while holding it succeeds
    finally:
        keeper.close()
    assert list(tmp_path.iterdir()) == []


def test_a_segment_whose_name_was_removed_is_not_taken_for_writing(tmp_path):
    keeper = SegmentKeeper(tmp_path, "seg-")
    try:
        segment = keeper.create(64)
        segment.unlock()
        os.unlink(segment.path)  # no reader can open it by its name any more: writing it would be for nobody
        assert not segment.try_lock()
        Path(segment.path).write_bytes(b"another file under the same name")
        assert not segment.try_lock()
    finally:
        keeper.close()


def test_closing_a_segment_keeps_the_mapping_for_buckets_still_packed_into_it(tmp_path):
    if kept_segments._storage_users(torch.empty(0)) is None:
        pytest.skip("this torch cannot count a storage's users")
    keeper = SegmentKeeper(tmp_path, "seg-")
    segment = keeper.create(4096)
    bucket = segment.view[64:128]
    bucket.fill_(3)
    assert segment.held_outside()
    keeper.drop(segment)
    assert not segment.path.exists() and len(keeper) == 0
    assert int(bucket.sum()) == 3 * 64  # still mapped: reading it is no use-after-unmap
    del bucket
    gc.collect()
    keeper.close()


def test_a_writer_left_unclosed_unlinks_its_segments_when_collected(tmp_path):
    keeper = SegmentKeeper(tmp_path, "seg-")
    keeper.create(64)
    keeper.create(64, tag="b")
    assert len(list(tmp_path.iterdir())) == 2
    del keeper
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_no_room_is_one_line_in_the_callers_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kept_segments, "shm_free_bytes", lambda _d: 3 * 2**20)
    check_shm_room(tmp_path, 2**20)
    with pytest.raises(ValueError, match=r"^\S+ has 3 MiB free but a weight version needs 8 MiB: .*--shm-size"):
        check_shm_room(tmp_path, 8 * 2**20, what="a weight version", error=ValueError)
    keeper = SegmentKeeper(tmp_path, "seg-")
    with pytest.raises(RuntimeError, match="has 3 MiB free"):
        keeper.create(8 * 2**20)
    assert list(tmp_path.iterdir()) == [] and len(keeper) == 0  # refused before any file was made
    keeper.close()
