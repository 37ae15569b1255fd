"""Writes finished generations to the store as the rollout columns, in batches, and acknowledges their leases.

A request is written once (its result, or None for a row settled without
one: placeholder columns). Writes are batched: whatever arrived within ``interval_s`` of the first
row, or, once 64 rows wait or a lease's last row comes, every row written by
the end of that event-loop turn (an engine's burst of results is one put, and
the end of a lease waits for no timer); a lease is acknowledged once every
row it carried was written.

A multi-turn episode is written as a :class:`~asyncflow_core.types.episode.Trajectory`
(the writer's ``columns`` then include :data:`asyncflow_core.columns.EPISODE_COLUMNS`):
``response_ids`` are every token after the prompt, sampled and observed, in
order; ``loss_mask`` is 1 on sampled tokens; observed tokens get log-prob 0
and, in ``response_versions``, the version of the last sampled token before
them (so a row's oldest version is its oldest sampled token's); ``turn_ids``
number each token's turn; ``turn_rewards`` hold one reward per turn; the
``episode_*`` columns the per-episode figures (``episode_tool_s`` and
``episode_correct`` NaN when the episode did not report them); ``reward`` the episode's
reward when the environment (or a captured agent's episode) owns it. An
episode whose prompt is not the row's stored ``prompt_ids`` (an
environment's first observation rendered with its tools, an agent's first
call) also writes ``prompt_ids``: the trained sequence is the one sampled.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import FinishReason, GenerationResult, RaggedTensor
from asyncflow_core.types.episode import Trajectory

#: The columns the rollout writes per row.
ROLLOUT_OUT = (C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.RESPONSE_VERSIONS, C.TRUNCATED)

_BATCH_ROWS = 64


class TrajectoryWriter:
    """Buffers ``(request, result)`` pairs and puts them as :data:`ROLLOUT_OUT` columns.

    A request has ``row`` and ``lease`` (with ``meta`` and a ``remaining`` row count). ``spawn`` runs the
    timed flush as a task of the owner; ``on_written`` is called after each flush.
    """

    def __init__(self, stage: str, *, interval_s: float, spawn: Callable[[Any], None],
                 on_written: Callable[[], None], columns: tuple[str, ...] = ROLLOUT_OUT) -> None:
        self.stage = stage
        self.columns = columns  #: what each row gets: :data:`ROLLOUT_OUT`, plus the episode columns for episodes
        self.interval_s = interval_s
        self.spawn = spawn
        self.on_written = on_written
        self.ctx: Any = None  #: the run's context (store, version, counters), given by the owning stage's bind
        #: an inline reward (flow/reward_inline.py): ``await score(ctx, rows, items, cols)`` gives the reward columns,
        #: put together with the rollout columns of single-turn results; None: a reward stage scores them
        self.score: Callable[..., Any] | None = None
        self._buffer: list[tuple[Any, GenerationResult | Trajectory | None]] = []
        self._flush_scheduled = False
        #: a flush is scheduled for the end of this loop turn (64 rows wait, or a lease's last row came)
        self._flush_soon = False
        #: rows waiting in the buffer per lease (id of the lease object)
        self._held: dict[int, int] = {}

    async def write(self, req: Any, res: GenerationResult | Trajectory | None) -> None:
        self._buffer.append((req, res))
        lease = req.lease
        held = self._held[id(lease)] = self._held.get(id(lease), 0) + 1
        # the lease's last row (every row it carried is written or waiting here): nothing more of it will come, so
        # waiting out the interval would only delay its groups (in a sync step, the step itself)
        if len(self._buffer) >= _BATCH_ROWS or held >= lease.remaining:
            if not self._flush_soon:
                # at the end of this event-loop turn, not now: the rest of an engine's burst of results (the
                # torch engine hands a whole batch over at once) joins the same put, one store call per burst
                self._flush_soon = True
                asyncio.get_running_loop().call_soon(lambda: self.spawn(self.flush()))
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(self.interval_s, lambda: self.spawn(self.flush()))

    async def flush(self) -> None:
        self._flush_scheduled = self._flush_soon = False
        if not self._buffer:
            return
        ctx = self.ctx
        items, self._buffer = self._buffer, []
        self._held = {}
        rows = torch.tensor([q.row for q, _ in items], dtype=torch.int64)
        if len(self.columns) > len(ROLLOUT_OUT):
            cols, vrange, sampled = self._episode_columns(items)
        else:
            cols, vrange, sampled = self._result_columns(items)
            if self.score is not None:
                cols.update(await self.score(ctx, rows, items, cols))
        await ctx.store.put(cols, rows=BatchMeta(row_ids=rows), versions=torch.tensor(vrange))
        ctx.processed[self.stage] += len(items)
        ctx.counters["tokens_generated"] += sampled
        done: dict[int, Any] = {}
        for q, _ in items:
            q.lease.remaining -= 1
            if q.lease.remaining == 0:
                done[id(q.lease)] = q.lease
        for lease in done.values():
            await ctx.store.ack(lease.meta)
        self.on_written()

    def _result_columns(self, items: list) -> tuple[dict[str, Any], list[tuple[int, int]], int]:
        """:data:`ROLLOUT_OUT` of single-turn results, one tensor per column for the whole write.

        Results holding plain sequences (the ``torch`` engine's lists) are chained into one list per column
        and become one tensor each; a write in which some result holds tensors (a simulated engine's
        lengths-only ids) is packed tensor by tensor (:meth:`_tensor_columns`). Either way there is no
        per-token Python loop, and no per-row tensor op on the common path: a torch call costs a few µs of
        the driver's GIL, which the rollout engine's thread waits for.
        """
        ctx = self.ctx
        version = ctx.version
        vrange: list[tuple[int, int]] = []
        cut: list[bool] = []
        lengths: list[int] = []
        tensors = False
        for q, res in items:
            if res is None:
                cut.append(False)
                lengths.append(0)
                vrange.append((version, version))
                continue
            cut.append(res.finish_reason is FinishReason.LENGTH)
            tensors = tensors or isinstance(res.token_ids, torch.Tensor) or isinstance(res.logprobs, torch.Tensor) \
                or isinstance(res.versions, torch.Tensor)
            lengths.append(len(res.token_ids))
            lo = res.min_version if res.min_version is not None else version
            origin = getattr(q, "origin_version", None)  # set under staleness_basis: request_start
            if origin is not None:
                lo = min(lo, origin)  # the row's age counts from its request's start
            hi = res.max_version if res.max_version is not None else version
            vrange.append((lo, hi))
        if tensors:
            ids, lps, vers = self._tensor_columns(items)
        else:
            done = [res for _, res in items if res is not None]
            ids = torch.tensor(list(chain.from_iterable(r.token_ids for r in done)), dtype=torch.int64)
            lps = torch.tensor(list(chain.from_iterable(r.logprobs for r in done)), dtype=torch.float32)
            vers = torch.tensor(list(chain.from_iterable(r.versions for r in done)), dtype=torch.int64)
        lens = torch.tensor(lengths, dtype=torch.int64)
        cols = {
            C.RESPONSE_IDS: RaggedTensor.from_lengths(ids, lens),
            C.BEHAVIOR_LOGPROBS: RaggedTensor.from_lengths(lps, lens),
            C.RESPONSE_VERSIONS: RaggedTensor.from_lengths(vers, lens),
            C.TRUNCATED: torch.tensor(cut, dtype=torch.bool),
        }
        return cols, vrange, sum(lengths)

    @staticmethod
    def _tensor_columns(items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, log-probs and versions of results some of which hold tensors, concatenated row by row."""
        ids, lps, vers = [], [], []
        for _, res in items:
            if res is None:
                ids.append(torch.empty(0, dtype=torch.int64))
                lps.append(torch.empty(0, dtype=torch.float32))
                vers.append(torch.empty(0, dtype=torch.int64))
                continue
            ids.append(torch.as_tensor(res.token_ids, dtype=torch.int64))
            lps.append(torch.as_tensor(res.logprobs, dtype=torch.float32))
            # versions are stored at the width of the token ids: lengths-only (zero-width) ids of a simulated
            # engine get lengths-only versions (the row's version range is put beside them, above)
            v = torch.as_tensor(res.versions, dtype=torch.int64)
            vers.append(v if ids[-1].dim() == 1 else v.new_empty((v.shape[0], *ids[-1].shape[1:])))
        return torch.cat(ids), torch.cat(lps), torch.cat(vers)

    def _episode_columns(self, items: list) -> tuple[dict[str, Any], list[tuple[int, int]], int]:
        """:attr:`columns` of episodes (a :class:`Trajectory` per row; None: a placeholder row)."""
        ctx = self.ctx
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        mask: list[bool] = []
        turn: list[int] = []
        lens, rlens, rewards, vrange, cut = [], [], [], [], []
        turn_rewards: list[float] = []
        dense: dict[str, list] = {c: [] for c in (C.EPISODE_TURNS, C.EPISODE_TOOL_CALLS, C.EPISODE_TOOL_OK,
                                                  C.EPISODE_ENV_S, C.EPISODE_MASKED_FRAC, C.EPISODE_TOOL_S,
                                                  C.EPISODE_CORRECT)}
        sampled_total = 0
        for q, traj in items:
            if traj is None:
                traj = Trajectory(prompt_ids=())
            if isinstance(traj, GenerationResult):
                raise TypeError("an episode writer got a single-turn result; give it the episode's Trajectory")
            n0 = len(ids)
            carried: int | None = None
            lo: int | None = None
            hi: int | None = None
            for seg in traj.segments:
                k = len(seg.token_ids)
                ids.extend(seg.token_ids)
                mask.extend([seg.sampled] * k)
                turn.extend([seg.turn] * k)
                if seg.sampled:
                    lps.extend(seg.logprobs)
                    vers.extend(seg.versions)
                    sampled_total += k
                    if k:
                        carried = seg.versions[-1]
                        lo = min(seg.versions) if lo is None else min(lo, min(seg.versions))
                        hi = max(seg.versions) if hi is None else max(hi, max(seg.versions))
                else:
                    if carried is None:
                        raise ValueError("an episode's observed tokens must follow a sampled turn (the prompt is "
                                         "prompt_ids)")
                    lps.extend([0.0] * k)
                    vers.extend([carried] * k)
            lens.append(len(ids) - n0)
            turn_rewards.extend(traj.turn_rewards)
            rlens.append(len(traj.turn_rewards))
            rewards.append(0.0 if traj.reward is None else float(traj.reward))
            origin = getattr(q, "origin_version", None)  # set under staleness_basis: request_start
            if origin is not None and lo is not None:
                lo = min(lo, origin)  # the episode's age counts from its first request's start
            vrange.append((ctx.version if lo is None else lo, ctx.version if hi is None else hi))
            info = traj.info
            cut.append(bool(info.get("truncated", False)))
            dense[C.EPISODE_TURNS].append(traj.turns)
            dense[C.EPISODE_TOOL_CALLS].append(int(info.get("tool_calls", 0)))
            dense[C.EPISODE_TOOL_OK].append(int(info.get("tool_ok", 0)))
            dense[C.EPISODE_ENV_S].append(float(info.get("env_s", 0.0)))
            dense[C.EPISODE_TOOL_S].append(float(info.get("tool_s", math.nan)))  # NaN: not reported
            dense[C.EPISODE_CORRECT].append(float(info.get("correct", math.nan)))
            n = len(ids) - n0
            dense[C.EPISODE_MASKED_FRAC].append((n - sum(mask[n0:])) / n if n else 0.0)
        lengths = torch.tensor(lens, dtype=torch.int64)
        cols: dict[str, Any] = {
            C.RESPONSE_IDS: RaggedTensor.from_lengths(torch.tensor(ids, dtype=torch.int64), lengths),
            C.BEHAVIOR_LOGPROBS: RaggedTensor.from_lengths(torch.tensor(lps, dtype=torch.float32), lengths),
            C.RESPONSE_VERSIONS: RaggedTensor.from_lengths(torch.tensor(vers, dtype=torch.int64), lengths),
            C.TRUNCATED: torch.tensor(cut, dtype=torch.bool),
            C.LOSS_MASK: RaggedTensor.from_lengths(torch.tensor(mask, dtype=torch.bool), lengths),
            C.TURN_IDS: RaggedTensor.from_lengths(torch.tensor(turn, dtype=torch.int64), lengths),
            C.TURN_REWARDS: RaggedTensor.from_lengths(torch.tensor(turn_rewards, dtype=torch.float32),
                                                      torch.tensor(rlens, dtype=torch.int64)),
        }
        for name, values in dense.items():
            cols[name] = torch.tensor(values, dtype=C.STANDARD_COLUMN_TYPES[name][1])
        if C.REWARD in self.columns:
            cols[C.REWARD] = torch.tensor(rewards, dtype=torch.float32)
        out = {c: cols[c] for c in self.columns}
        prompts = _episode_prompts(items)
        if prompts is not None:
            out[C.PROMPT_IDS] = RaggedTensor.from_sequences([torch.tensor(p, dtype=torch.int64) for p in prompts])
        return out, vrange, sampled_total


def _episode_prompts(items: list) -> list[tuple[int, ...]] | None:
    """Each row's prompt when some episode's first prompt is not the row's stored one, else None.

    An environment's rendered first observation (with its tools), or an agent's first call, is the prompt its
    turns were sampled after: the row's ``prompt_ids`` are replaced by it, in the same write as the response,
    before any later stage reads the row. The other rows of the write keep their stored prompt.
    """
    def stored(q: Any) -> tuple[int, ...]:
        return tuple(getattr(q, "prompt_stored", ()) or ())

    if not any(t is not None and stored(q) and tuple(t.prompt_ids) and tuple(t.prompt_ids) != stored(q)
               for q, t in items):
        return None
    return [tuple(t.prompt_ids) if t is not None and t.prompt_ids else (stored(q) or tuple(q.prompt))
            for q, t in items]
