"""A rank's bucket handed to the driver through shared memory (asyncflow_core.launchers.rank_worker / rank_driver)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncflow_core.errors import EngineError
from asyncflow_core.launchers.rank_driver import from_shared_memory
from asyncflow_core.launchers.rank_worker import KEPT_PREFIX, KeptSegments, RankWorkerBase, to_shared_memory
from asyncflow_core.types import WeightBucket


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 1_000_003])
def test_a_bucket_arrives_intact_and_its_segment_name_is_gone(nbytes):
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    name = to_shared_memory(buffer)
    got = from_shared_memory(name, nbytes)
    assert got.dtype == torch.uint8 and got.numel() == nbytes and torch.equal(got, buffer)
    assert not (Path("/dev/shm") / name.lstrip("/")).exists()  # nothing left behind for anyone to open
    got += 1  # the driver owns the bytes: writable, and nothing else sees the write
    assert torch.equal(got, buffer + 1)
    del got
    gc.collect()


# ---------------------------------------------------------------- kept segments (reused across versions)

needs_dev_shm = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="kept segments need /dev/shm (Linux)")


class _Worker(RankWorkerBase):
    def __init__(self) -> None:
        super().__init__(0, 1, None)


def _named(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [("a", torch.randn(3000, generator=gen)), ("b", torch.randn(5000, generator=gen)),
            ("c", torch.randn(700, generator=gen))]


def _export(worker: _Worker, version: int) -> list[WeightBucket]:
    """What the driver's export_weights does with one chunk: map each bucket the rank packed."""
    described = worker.ship_buckets(_named(version), {"version": version, "bucket_bytes": 16_000, "index": 0})
    buckets = [WeightBucket(version, i, tuple(d["metas"]), from_shared_memory(d["shm"], d["nbytes"], kept=d["kept"]),
                            d["checksum"], i == len(described) - 1) for i, d in enumerate(described)]
    for b in buckets:
        b.verify()
    return buckets


def _segments(buckets: list[WeightBucket]) -> set[int]:
    return {b.buffer.untyped_storage().data_ptr() for b in buckets}


@needs_dev_shm
def test_a_rank_reuses_its_segments_once_the_driver_no_longer_maps_them():
    worker = _Worker()
    try:
        v1 = _export(worker, 1)
        names1 = sorted(p.name for p in Path("/dev/shm").glob(f"{KEPT_PREFIX}{os.getpid()}-*"))
        assert len(names1) == len(v1) >= 2  # one kept segment per bucket, not unlinked by the driver
        saved = [b.buffer.clone() for b in v1]
        v2 = _export(worker, 2)  # the driver still maps version 1 (a transport has it staged): other segments
        assert all(torch.equal(b.buffer, s) for b, s in zip(v1, saved, strict=True))  # version 1 untouched
        assert worker._segments.stats()["reused_bytes"] == 0
        del v1
        gc.collect()  # the driver drops version 1: its mappings, and with them its locks, go
        v3 = _export(worker, 3)
        stats = worker._segments.stats()
        assert stats["reused_bytes"] == sum(x.nbytes for x in v3) and stats["segments"] == 2 * len(v3)
        assert stats["fresh_bytes"] == 0
        for v, got in ((2, v2), (3, v3)):
            want = {n: t for n, t in _named(v)}
            assert all(torch.equal(t, want[n]) for b in got for n, t in b.tensors())
        del v2, v3
    finally:
        worker.close()
    gc.collect()
    assert not list(Path("/dev/shm").glob(f"{KEPT_PREFIX}{os.getpid()}-*"))  # close() unlinks them


@needs_dev_shm
def test_with_every_kept_segment_mapped_a_bucket_gets_a_fresh_segment_the_driver_unlinks():
    worker = _Worker()
    worker._segments = KeptSegments(max_per_bucket=2)
    try:
        held = [_export(worker, v) for v in (1, 2, 3)]  # the driver maps all three versions at once
        assert worker._segments.stats()["fresh_bytes"] == sum(b.nbytes for b in held[2])
        for v, got in zip((1, 2, 3), held, strict=True):
            want = dict(_named(v))
            assert all(torch.equal(t, want[n]) for b in got for n, t in b.tensors())
        assert not list(Path("/dev/shm").glob(f"asyncflow-rankx-{os.getpid()}-*"))
    finally:
        worker.close()


@needs_dev_shm
def test_the_driver_refuses_a_segment_the_rank_is_writing_and_one_that_is_gone(tmp_path):
    segments = KeptSegments()
    names: dict[int, tuple[str, bool]] = {}
    try:
        view = segments.allocator(0, names)(4096)  # being packed: the rank holds the exclusive lock
        view.fill_(7)
        name = names[0][0]
        with pytest.raises(EngineError, match="still writing"):
            from_shared_memory(name, 4096)
        segments.release()
        assert int(from_shared_memory(name, 4096)[0]) == 7
    finally:
        segments.close()
    with pytest.raises(EngineError, match="is gone"):
        from_shared_memory(name, 4096)


@needs_dev_shm
def test_segments_of_a_killed_rank_are_removed_by_the_next_rank():
    code = ("import os, signal; from asyncflow_core.launchers.rank_worker import KeptSegments; "
            "s = KeptSegments(); n = {}; s.allocator(0, n)(4096); s.release(); print(n[0][0], flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    name = out.stdout.strip()
    assert name.startswith(KEPT_PREFIX) and (Path("/dev/shm") / name).exists()  # left behind by the killed rank
    KeptSegments().close()
    assert not (Path("/dev/shm") / name).exists()


@needs_dev_shm
def test_a_full_shared_memory_file_system_is_refused_in_one_line_and_kept_segments_yield_to_fresh(monkeypatch):
    from asyncflow_core import kept_segments

    worker = _Worker()
    try:
        nbytes = max(d["nbytes"] for d in worker.ship_buckets(_named(1), {"version": 1, "bucket_bytes": 16_000}))
        worker.close()
        worker = _Worker()
        # room for the largest bucket but not for keeping it beside the next: such buckets go to fresh segments
        free = nbytes + 1
        monkeypatch.setattr(kept_segments, "shm_free_bytes", lambda _d: free)
        got = _export(worker, 2)
        stats = worker._segments.stats()
        tight = [b for b in got if 2 * b.nbytes > free]
        assert tight and stats["fresh_bytes"] == sum(b.nbytes for b in tight)
        assert stats["segments"] == len(got) - len(tight)
        want = dict(_named(2))
        assert all(torch.equal(t, want[n]) for b in got for n, t in b.tensors())
        del got
        # no room at all: one line naming the file system and the fix, never a SIGBUS on the first page past it
        monkeypatch.setattr(kept_segments, "shm_free_bytes", lambda _d: 1024)
        with pytest.raises(RuntimeError, match=r"^/dev/shm has 0 MiB free but a weight bucket needs .*--shm-size"):
            _export(worker, 3)
        assert not list(Path("/dev/shm").glob(f"asyncflow-rankx-{os.getpid()}-*"))  # nothing half-made left
    finally:
        worker.close()
    gc.collect()
