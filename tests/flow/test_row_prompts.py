"""The rollout stage's per-row prompt tuples: rows of a group that repeat its prompt share one tuple."""

from __future__ import annotations

import torch

from asyncflow_core.flow.prompts import row_prompts
from asyncflow_core.types import RaggedTensor


def test_rows_get_their_own_ids_and_repeats_share_a_tuple() -> None:
    seqs = [[1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 4], [1, 2, 3], [4, 5], [], [7]]
    gids = [0, 0, 1, 0, 0, 1, 2, 0]  # group 0 holds a row with other ids (and one of another length)
    out = row_prompts(RaggedTensor.from_sequences([torch.tensor(s, dtype=torch.int64) for s in seqs]), gids)
    assert out == [tuple(s) for s in seqs]
    assert all(type(p) is tuple and all(type(t) is int for t in p) for p in out)
    assert out[1] is out[0] and out[4] is out[0] and out[5] is out[2]
    assert out[3] is not out[0] and out[7] is not out[0]
