"""A rank's bucket handed to the driver through shared memory (asyncflow_core.launchers.rank_worker / rank_driver)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from asyncflow_core.launchers.rank_driver import from_shared_memory
from asyncflow_core.launchers.rank_worker import to_shared_memory


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
