"""The reward stage: scores each completion with the reward plugin; a sample whose reward fails is failed.

The extra values a reward returns beside ``reward`` (``correct``,
``answer_found``) are declared store columns: one dense float32 column
``reward_extra/<key>`` per key of ``RewardFeatures.extras``, NaN for a
sample that lacks the key. The trainer receives them with its batch, and each
step's record averages them (:func:`reward_extras`). A key the reward returns
without declaring it is reported once, with the fix, and not recorded.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from asyncflow_core import columns as C
from asyncflow_core.flow.stage import Stage, StageOutput
from asyncflow_core.flow.tokenizer import Tokenizer
from asyncflow_core.interfaces import Reward
from asyncflow_core.interfaces.features import reward_features
from asyncflow_core.types import Batch, RaggedTensor, RewardInput

__all__ = ["RewardStage", "reward_extras", "score_each"]

log = logging.getLogger(__name__)


class RewardStage(Stage):
    """Scores each completion with the reward plugin; a sample whose reward raises or times out is failed."""

    name = "reward"
    consumes = (C.PROMPT_IDS, C.RESPONSE_IDS, C.GROUP_ID)
    produces = (C.REWARD,)
    span_name = "score"

    def __init__(self, reward: Reward, tokenizer: Tokenizer, *, workers: int, timeout_s: float,
                 batch_size: int = 32, reward_name: str | None = None) -> None:
        self.reward = reward
        self.tokenizer = tokenizer
        self.concurrency = workers
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.features = reward_features(reward)
        self.needs_text = self.features.needs_text
        self.reward_name = reward_name  #: the plugin's registered name, for error messages
        self.extra_keys = self.features.extras  #: the extra values it declares, one column each
        self.produces = (C.REWARD, *(C.reward_extra(k) for k in self.extra_keys))
        self.undeclared: Counter[str] = Counter()  #: extra keys returned but not declared: samples that had each

    async def process(self, batch: Batch) -> StageOutput:
        ctx = self.ctx
        n = batch.num_rows
        gids = batch[C.GROUP_ID].tolist()
        rows = batch.row_ids.tolist() if batch.row_ids is not None else list(range(n))
        samples = [RewardInput(prompt=record.prompt if record else "", completion=text,
                               prompt_token_ids=prompt, completion_token_ids=completion,
                               metadata=dict(record.metadata) if record else {})
                   for record, text, prompt, completion in zip(self._records(gids), *self._texts(batch))]
        if self.features.supports_score_many:
            # a remote reward pool scores the whole batch in one round trip: (True, value) or (False, why) each
            answers = await self.reward.score_many(samples, self.timeout_s)  # type: ignore[attr-defined]
        else:
            answers = await score_each(self.reward, samples, self.timeout_s)
        # plain lists, one tensor per column at the end: a per-sample tensor write costs the driver's GIL
        out = [0.0] * n
        slot = {k: j for j, k in enumerate(self.extra_keys)}
        extras = [[math.nan] * n for _ in slot]
        for i, (ok, value) in enumerate(answers):
            try:
                if not ok:
                    raise _Failed(value)
                if type(value) is dict or isinstance(value, Mapping):  # dict first: an ABC check costs µs a row
                    if "reward" not in value:
                        raise ValueError(f"reward {self._label()} returned a mapping without a 'reward' key "
                                         f"(keys: {sorted(map(str, value))}); return {{'reward': <number>, ...}}")
                    extra = {str(key): self._number(v, f"extra value {key!r}") for key, v in value.items()
                             if key != "reward"}
                    out[i] = self._number(value["reward"], "value")
                    for key, v in extra.items():
                        j = slot.get(key)
                        if j is not None:
                            extras[j][i] = v
                        else:
                            self._undeclared(key)
                else:
                    out[i] = self._number(value, "value")
            except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the run goes on
                why = str(exc) if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
                ctx.fail_rows(self.name, [rows[i]], why)
        return StageOutput({C.REWARD: torch.tensor(out, dtype=torch.float32),
                            **{C.reward_extra(k): torch.tensor(extras[j], dtype=torch.float32)
                               for k, j in slot.items()}})

    def _records(self, gids: list[int]) -> list[Any]:
        """Each row's prompt record (None for a group the ledger no longer holds)."""
        groups = self.ctx.ledger.groups
        infos = [groups.get(int(g)) for g in gids]
        return [info.record if info is not None else None for info in infos]

    def _texts(self, batch: Batch) -> tuple[list[str], list[tuple], list[tuple]]:
        """Per row: completion text, prompt ids, completion ids; empty unless the reward ``needs_text``.

        One ``tolist`` per column, sliced by the offsets in Python: the same values a per-row
        ``ids[i].tolist()`` gives, without two tensor calls per row.
        """
        n = batch.num_rows
        if not self.needs_text:
            return [""] * n, [()] * n, [()] * n
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
        completions = _split(resp)
        decode = self.tokenizer.decode
        return [decode(c) for c in completions], [tuple(p) for p in _split(prompts)], [tuple(c) for c in completions]

    def _undeclared(self, key: str) -> None:
        if not self.undeclared[key]:
            log.warning("reward %s returned the extra value %r without declaring it, so it is not recorded; declare "
                        "it (RewardFeatures(extras=(%r, ...)) in its features, or a class attribute extras) to get a "
                        "%s column and a reward/%s metric", self._label(), key, key, C.reward_extra(key), key)
        self.undeclared[key] += 1

    def _label(self) -> str:
        return repr(self.reward_name) if self.reward_name else type(self.reward).__name__

    def _number(self, value: Any, what: str) -> float:
        """``value`` as a float; anything but a finite real number fails the sample (a NaN would poison training)."""
        if type(value) is float and math.isfinite(value):  # the common case, without the ABC check below
            return value
        if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            number = float(value)
            if math.isfinite(number):
                return number
        raise ValueError(f"reward {self._label()} returned {what} {value!r}, not a finite number; "
                         "a reward must return a float (or a mapping with a float 'reward')")


class _Failed(Exception):
    """A reward that raised or timed out; the message is already the sample's recorded error."""


async def score_each(reward: Reward, samples: list[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
    """``(True, value)`` or ``(False, why)`` per sample, one after the other (an async reward awaited each, up to
    ``timeout_s``); a reward that raised or timed out is a ``(False, why)``, never an exception."""
    answers: list[tuple[bool, Any]] = []
    for sample in samples:
        try:
            value = reward.score(sample)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
            answers.append((True, value))
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            answers.append((False, f"timed out after {timeout_s}s"))
        except Exception as exc:  # noqa: BLE001 - recorded on the sample by the caller
            answers.append((False, f"{type(exc).__name__}: {exc}"))
    return answers


def _split(ragged: RaggedTensor) -> list[list]:
    """Each row of ``ragged`` as a Python list (``ragged[i].tolist()``), from one ``tolist`` of the values."""
    values = ragged.values.tolist()
    offsets = ragged.offsets.tolist()
    return [values[a:b] for a, b in zip(offsets, offsets[1:])]




def reward_extras(batch: Batch) -> dict[str, float]:
    """Per declared extra value (``correct``), its mean over ``batch``'s rows that have it (NaN rows skipped)."""
    out: dict[str, float] = {}
    for col in sorted(batch.columns):
        if col.startswith(C.REWARD_EXTRA_PREFIX):
            values = batch[col].float()  # type: ignore[union-attr]
            seen = values[~torch.isnan(values)]
            if seen.numel():
                out[col[len(C.REWARD_EXTRA_PREFIX):]] = float(seen.mean())
    return out
