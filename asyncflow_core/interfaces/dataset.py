"""The Dataset contract: a map-style source of prompts with stable indices."""

from __future__ import annotations

import abc

from asyncflow_core.types import PromptRecord


class Dataset(abc.ABC):
    """A finite, indexable set of prompts.

    Indices are stable across processes and runs (the runtime's data cursor
    and resume depend on it); shuffling is the runtime's job (a seeded
    permutation of indices), not the dataset's.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of records."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> PromptRecord:
        """Record ``index`` (``0 <= index < len(self)``; else ``IndexError``), with ``record.index == index``."""
