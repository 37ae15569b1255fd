"""Built-in samplers: which ready rows a ``get_meta`` call hands out.

All are deterministic functions of their inputs and vectorised (token
balancing runs Karmarkar–Karp over the chosen batch only).

Data parallelism. ``SampleRequest.batch_size`` is the *global* batch of a DP
group; a sampler returns the part for ``request.dp_rank``. The controller
forms one global pick per DP round: it calls the sampler once per rank on the
*same* :class:`Candidates`, and because each sampler here is a pure function
of (candidates, batch size, dp size), the per-rank parts are disjoint pieces
of one pick. All parts are leased at once and each rank claims its own (see
``Controller.try_lease``), so ranks that ask at different times still share
one pick. A sampler that does expensive work for the global pick (token
balancing) caches it for the candidates object it was last given.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces.sampler import Candidates, Sampler, SampleRequest
from asyncflow_core.plugins import NoOptions, SamplerBackend, hookimpl
from asyncflow_core.store.errors import InvalidRequestError

_EMPTY = torch.empty(0, dtype=torch.int64)


def _rank_chunk(positions: torch.Tensor, request: SampleRequest) -> torch.Tensor:
    """Contiguous chunk ``dp_rank`` of ``dp_size`` near-equal chunks (earlier ranks get the extra row)."""
    if request.dp_size == 1:
        return positions
    return torch.tensor_split(positions, request.dp_size)[request.dp_rank]


def _oldest(candidates: Candidates, request: SampleRequest) -> torch.Tensor | None:
    """Positions of the oldest ``batch_size`` candidates, or None if a full batch is needed and absent."""
    n = len(candidates)
    if n == 0 or (n < request.batch_size and not request.partial):
        return None
    return torch.arange(min(n, request.batch_size), dtype=torch.int64)


class FifoSampler(Sampler):
    """Oldest rows first; a DP group's pick is split into contiguous, near-equal chunks."""

    takes_oldest = True  #: a single-rank pick is the oldest rows (see Sampler.takes_oldest): the store skips it

    def __init__(self, config: BaseModel | None = None) -> None:
        pass

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        pick = _oldest(candidates, request)
        return _EMPTY if pick is None else _rank_chunk(pick, request)


class GroupSamplerConfig(BaseModel):
    """Options of the ``group`` sampler."""

    model_config = ConfigDict(extra="forbid")
    group_size: int | None = Field(
        None,
        ge=1,
        description="Rows per complete prompt group (GRPO's n). None: take it from the store (its group_size option).",
    )


class GroupSampler(Sampler):
    """Whole prompt groups only: a group is handed out when all of its ``group_size`` rows are ready.

    Oldest complete groups first (by their oldest row); ``batch_size`` must be
    a multiple of the group size. A DP pick is split by whole groups.
    Rows without a group (group id -1) are never handed out by this sampler.
    """

    def __init__(self, config: GroupSamplerConfig | None = None) -> None:
        self.group_size = (config or GroupSamplerConfig()).group_size

    def whole_group_size(self, store_group_size: int) -> int:
        """Rows per group this sampler hands out (0: not known yet). The in-process store reads it to wake a
        waiting lease only when a write may have completed a group, instead of on every write."""
        return self.group_size or store_group_size

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        gs = self.group_size or candidates.group_size
        if gs <= 0:
            raise InvalidRequestError(
                "the group sampler needs a group size: set the store's group_size option or the sampler's "
                "group_size option"
            )
        if request.batch_size % gs:
            raise InvalidRequestError(
                f"batch_size {request.batch_size} is not a multiple of the group size {gs}; the group sampler "
                "hands out whole groups only"
            )
        wanted = request.batch_size // gs
        # numpy (the candidates are CPU tensors): a dozen small-array ops on the calling thread; in torch each
        # is a dispatch and a release of the GIL that the driver's rollout engine thread takes
        g = candidates.group_ids.numpy()
        n = g.size
        vpos = np.flatnonzero((g >= 0) & (candidates.group_ready.numpy() >= gs))
        if vpos.size == 0:
            return _EMPTY
        uniq, inv = np.unique(g[vpos], return_inverse=True)
        inv = inv.reshape(-1)
        first = np.full(uniq.size, n, dtype=np.int64)
        np.minimum.at(first, inv, vpos)
        age_rank = np.empty_like(first)
        age_rank[np.argsort(first)] = np.arange(first.size)  # first positions are distinct: no ties
        take = min(wanted, uniq.size)
        if take < wanted and not request.partial:
            return _EMPTY
        # rank of each row inside its group (vpos ascending + stable sort keeps arrival order)
        order = np.argsort(inv, kind="stable")
        sorted_inv = inv[order]
        seg_start = np.searchsorted(sorted_inv, sorted_inv)
        within = np.empty_like(inv)
        within[order] = np.arange(inv.size) - seg_start
        keep = (age_rank[inv] < take) & (within < gs)
        sel, sel_rank = vpos[keep], age_rank[inv[keep]]
        sel = torch.from_numpy(sel[np.argsort(sel_rank * (n + 1) + sel)].astype(np.int64, copy=False))
        if request.dp_size == 1:
            return sel
        groups = torch.tensor_split(torch.arange(take), request.dp_size)[request.dp_rank]
        if groups.numel() == 0:
            return _EMPTY
        return sel[int(groups[0]) * gs : (int(groups[-1]) + 1) * gs]


def karmarkar_karp(weights: list[int], k: int, *, equal_size: bool = True) -> list[list[int]]:
    """Split item indices into ``k`` parts with near-equal weight sums (largest differencing method).

    Each state is a k-tuple of (sum, items) partial parts sorted by sum; the
    two states with the largest spread are merged, heaviest part of one with
    lightest of the other, until one state is left. The final spread is at
    most the largest weight. With ``equal_size`` part sizes differ by at most
    one (items are first dealt k at a time in sorted order). Deterministic:
    ties break on insertion order.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []

    def push(parts: list[tuple[int, list[int]]]) -> None:
        parts.sort(key=lambda p: (-p[0], len(p[1]), p[1][:1]))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), next(counter), parts))

    if equal_size:
        for c in range(0, len(order), k):
            chunk = order[c : c + k]
            push([(weights[i], [i]) for i in chunk] + [(0, []) for _ in range(k - len(chunk))])
    else:
        for i in order:
            push([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    parts = [sorted(items) for _, items in heap[0][2]]
    return sorted(parts, key=lambda p: (-len(p), p[:1]))


class TokenBalancedConfig(BaseModel):
    """Options of the ``token_balanced`` sampler."""

    model_config = ConfigDict(extra="forbid")
    equal_size: bool = Field(True, description="Give every DP rank the same number of rows (±1) as well as balanced tokens.")


class TokenBalancedSampler(Sampler):
    """The oldest ``batch_size`` rows, split across DP ranks so per-rank token sums are balanced.

    The split is Karmarkar–Karp on the rows' token counts, computed once per
    global pick (cached for the candidates object the controller passes to
    every rank's call). Rank ``dp_rank`` gets part ``dp_rank``; parts are
    ordered largest first, each in arrival order.
    """

    takes_oldest = True  #: balancing is across DP ranks only; a single-rank pick is the oldest rows

    def __init__(self, config: TokenBalancedConfig | None = None) -> None:
        self.equal_size = (config or TokenBalancedConfig()).equal_size
        self._cache: tuple[Candidates, int, bool, int, list[torch.Tensor]] | None = None

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        pick = _oldest(candidates, request)
        if pick is None:
            return _EMPTY
        if request.dp_size == 1:
            return pick
        c = self._cache
        if c is not None and c[0] is candidates and c[1:4] == (request.batch_size, request.partial, request.dp_size):
            return c[4][request.dp_rank]
        tokens = candidates.num_tokens[pick].tolist()
        parts = [pick[torch.tensor(p, dtype=torch.int64)] if p else _EMPTY
                 for p in karmarkar_karp(tokens, request.dp_size, equal_size=self.equal_size)]
        self._cache = (candidates, request.batch_size, request.partial, request.dp_size, parts)
        return parts[request.dp_rank]


class SimilarLengthSampler(Sampler):
    """Rows of similar token count together: the oldest row plus the rows whose length is closest to it.

    Anchoring on the oldest row means no row waits forever. A DP pick is
    sorted by length and cut into contiguous chunks, so each rank's rows are
    alike too.
    """

    def __init__(self, config: BaseModel | None = None) -> None:
        pass

    def sample(self, candidates: Candidates, request: SampleRequest) -> torch.Tensor:
        n = len(candidates)
        if n == 0 or (n < request.batch_size and not request.partial):
            return _EMPTY
        tokens = candidates.num_tokens
        dist = (tokens - tokens[0]).abs()
        pick = torch.sort(dist, stable=True).indices[: request.batch_size]
        if request.dp_size > 1:
            pick = pick[torch.sort(tokens[pick], stable=True).indices]
            pick = _rank_chunk(pick, request)
        return torch.sort(pick).values


@hookimpl(tryfirst=True)
def asyncflow_samplers():
    yield SamplerBackend(name="fifo", factory=FifoSampler, config_model=NoOptions, description="Oldest ready rows first.")
    yield SamplerBackend(
        name="group",
        factory=GroupSampler,
        config_model=GroupSamplerConfig,
        description="Whole prompt groups only (all n samples of a prompt together), as GRPO needs.",
    )
    yield SamplerBackend(
        name="token_balanced",
        factory=TokenBalancedSampler,
        config_model=TokenBalancedConfig,
        description="Oldest rows, split across DP ranks with Karmarkar-Karp so per-rank token sums balance.",
    )
    yield SamplerBackend(
        name="similar_length",
        factory=SimilarLengthSampler,
        config_model=NoOptions,
        description="Rows of similar token count together, anchored on the oldest row.",
    )
