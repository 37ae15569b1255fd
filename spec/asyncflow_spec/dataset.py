"""Conformance tests for Dataset backends."""

from __future__ import annotations

import pytest

from asyncflow_core.interfaces import Dataset
from asyncflow_core.plugins import PluginKind
from asyncflow_core.types import PromptRecord
from asyncflow_spec.base import BackendSpec


class DatasetSpec(BackendSpec):
    """Subclass and set ``backend``/``options`` (pointing at a small dataset)."""

    kind = PluginKind.DATASET

    def test_records_have_stable_indices(self, make_backend):
        """``ds[i].index == i`` for every i, and two instances agree (indices drive resume)."""
        ds: Dataset = make_backend()
        other: Dataset = make_backend()
        assert len(ds) > 0, "point the spec at a non-empty dataset"
        for i in range(min(len(ds), 50)):
            rec = ds[i]
            assert isinstance(rec, PromptRecord) and rec.index == i
            assert other[i] == rec

    def test_out_of_range_is_index_error(self, make_backend):
        """``ds[len(ds)]`` and ``ds[-1]`` raise IndexError (negative indices are not positions)."""
        ds: Dataset = make_backend()
        with pytest.raises(IndexError):
            ds[len(ds)]
        with pytest.raises(IndexError):
            ds[-1]
