"""The Sampler contract: which ready rows to hand to a consumer."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Candidates:
    """Rows a consumer may be given: ready for its columns, free for its task, inside its version filter.

    All fields are 1-D tensors of equal length, in arrival order (oldest
    first). ``group_size`` is the number of rows a complete prompt group has
    (0 when rows are not grouped); ``group_ready`` counts, per candidate, the
    candidates sharing its group.
    """

    row_ids: torch.Tensor  #: int64
    group_ids: torch.Tensor  #: int64 (-1: no group)
    num_tokens: torch.Tensor  #: int64
    min_version: torch.Tensor  #: int64 (-1: not generated yet)
    group_ready: torch.Tensor  #: int64
    group_size: int = 0

    def __len__(self) -> int:
        return int(self.row_ids.numel())


@dataclass(frozen=True)
class SampleRequest:
    """What the consumer asked for."""

    batch_size: int  #: rows wanted (for a DP split: the global batch, over all ranks)
    partial: bool = False  #: accept fewer than ``batch_size`` rows if that is all there is
    dp_rank: int = 0
    dp_size: int = 1


class Sampler(abc.ABC):
    """Chooses rows for one ``get_meta`` call. Synchronous and vectorised: it runs on the store's hot path.

    Returns positions into ``candidates`` (int64, no duplicates). An empty
    tensor means "cannot form a batch yet"; the store then waits for more
    rows. A sampler never returns more than ``request.batch_size`` rows, and
    returns fewer only when ``request.partial`` is set. It must be a pure
    function of its inputs (and its own seeded state), so that a replayed run
    makes the same choices.
    """

    #: Declares that, for a single-rank request (``dp_size == 1``), :meth:`sample` returns the positions
    #: ``0 .. k - 1`` with ``k = min(len(candidates), batch_size)`` (the oldest candidates), and an empty
    #: tensor when there is no candidate or fewer than ``batch_size`` without ``partial``; that is, its pick
    #: depends on nothing but the number of candidates. A store may then lease the oldest eligible rows
    #: without building :class:`Candidates` or calling :meth:`sample` (a DP request still calls it). A
    #: subclass whose :meth:`sample` is not the declaring class's own or inherited one (it overrides it, or
    #: a base before it in the MRO brings another) gets False unless it sets this in its own class body.
    takes_oldest: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "takes_oldest" in cls.__dict__ or not cls.takes_oldest:
            return
        declared = next(k for k in cls.__mro__ if "takes_oldest" in k.__dict__)
        picks = next((k for k in cls.__mro__ if "sample" in k.__dict__), None)
        if picks not in declared.__mro__:  # the MRO, not issubclass: ABCMeta's check is not settled in here
            cls.takes_oldest = False  # another pick: the declaration of the class it came from no longer holds

    @abc.abstractmethod
    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        """Positions into ``candidates`` of the rows to lease to ``request``."""
