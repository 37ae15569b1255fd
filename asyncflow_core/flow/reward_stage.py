"""The reward stage: scores each completion with the reward plugin; a sample whose reward fails is failed."""

from __future__ import annotations

import asyncio
import inspect
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

__all__ = ["RewardStage", "reward_extras"]


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
        self.extra: Counter[str] = Counter()
        self.reward_name = reward_name  #: the plugin's registered name, for error messages
        #: row id -> the extra values the reward returned beside ``reward`` (read once per step, then dropped)
        self.row_extras: dict[int, dict[str, float]] = {}

    async def process(self, batch: Batch) -> StageOutput:
        ctx = self.ctx
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        prompts: RaggedTensor = batch[C.PROMPT_IDS]  # type: ignore[assignment]
        gids = batch[C.GROUP_ID].tolist()
        rows = batch.row_ids.tolist() if batch.row_ids is not None else list(range(batch.num_rows))
        out = torch.zeros(batch.num_rows, dtype=torch.float32)
        samples = []
        for i in range(batch.num_rows):
            info = ctx.ledger.groups.get(int(gids[i]))
            record = info.record if info is not None else None
            completion_ids = resp[i]
            samples.append(RewardInput(
                prompt=record.prompt if record else "",
                completion=self.tokenizer.decode(completion_ids.tolist()) if self.needs_text else "",
                prompt_token_ids=tuple(prompts[i].tolist()) if self.needs_text else (),
                completion_token_ids=tuple(completion_ids.tolist()) if self.needs_text else (),
                metadata=dict(record.metadata) if record else {},
            ))
        if self.features.supports_score_many:
            # a remote reward pool scores the whole batch in one round trip: (True, value) or (False, why) each
            answers = await self.reward.score_many(samples, self.timeout_s)  # type: ignore[attr-defined]
        else:
            answers = [await self._score_one(sample) for sample in samples]
        for i, (ok, value) in enumerate(answers):
            try:
                if not ok:
                    raise _Failed(value)
                if isinstance(value, Mapping):
                    if "reward" not in value:
                        raise ValueError(f"reward {self._label()} returned a mapping without a 'reward' key "
                                         f"(keys: {sorted(map(str, value))}); return {{'reward': <number>, ...}}")
                    extra = {str(key): self._number(v, f"extra value {key!r}") for key, v in value.items()
                             if key != "reward"}
                    self.extra.update(extra)
                    if extra:
                        if len(self.row_extras) >= 1 << 18:  # rows dropped before training never collect theirs
                            for old in sorted(self.row_extras)[: 1 << 17]:
                                del self.row_extras[old]
                        self.row_extras[int(rows[i])] = extra
                    value = value["reward"]
                out[i] = self._number(value, "value")
            except Exception as exc:  # noqa: BLE001 - one sample's failure is recorded, the run goes on
                why = str(exc) if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
                ctx.fail_rows(self.name, [rows[i]], why)
        return StageOutput({C.REWARD: out})

    async def _score_one(self, sample: RewardInput) -> tuple[bool, Any]:
        """``(True, value)``, or ``(False, why)`` when the reward raised or timed out."""
        try:
            value = self.reward.score(sample)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return True, value
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return False, f"timed out after {self.timeout_s}s"
        except Exception as exc:  # noqa: BLE001 - recorded on the sample by the caller
            return False, f"{type(exc).__name__}: {exc}"

    def _label(self) -> str:
        return repr(self.reward_name) if self.reward_name else type(self.reward).__name__

    def _number(self, value: Any, what: str) -> float:
        """``value`` as a float; anything but a finite real number fails the sample (a NaN would poison training)."""
        if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            number = float(value)
            if math.isfinite(number):
                return number
        raise ValueError(f"reward {self._label()} returned {what} {value!r}, not a finite number; "
                         "a reward must return a float (or a mapping with a float 'reward')")


class _Failed(Exception):
    """A reward that raised or timed out; the message is already the sample's recorded error."""




def reward_extras(stage: Stage | None, batch: Batch) -> dict[str, float]:
    """Means over ``batch``'s rows of the extra values a reward returned (e.g. ``correct`` beside a shaped reward);
    each row's values are handed out once."""
    extras = getattr(stage, "row_extras", None)
    if not extras or batch.row_ids is None:
        return {}
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for row in batch.row_ids.tolist():
        for key, v in extras.pop(int(row), {}).items():
            sums[key] += v
            counts[key] += 1
    return {key: sums[key] / counts[key] for key in sorted(sums)}
