"""Simulated workload: a ``sim`` dataset of synthetic prompts and a ``sim`` reward (no text involved)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.interfaces import Dataset, Reward
from asyncflow_core.types import PromptRecord, RewardInput
from asyncflow_plugins.sim.host import SimHostShare, host_for


class SimDatasetConfig(BaseModel):
    """Options of the ``sim`` dataset."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(4096, ge=1, description="Number of prompts.")
    prompt_tokens: int = Field(512, ge=1, description="Median prompt length in tokens.")
    prompt_sigma: float = Field(0.3, ge=0, description="Lognormal spread of prompt lengths (0: all equal).")
    vocab_size: int = Field(32000, ge=2, description="Token ids are drawn below this.")
    seed: int = Field(0, description="Seed of lengths and token ids.")


class SimDataset(Dataset):
    """``size`` prompts with lognormal lengths and random token ids, generated up front from ``seed``."""

    def __init__(self, config: SimDatasetConfig | None = None) -> None:
        c = config or SimDatasetConfig()
        gen = torch.Generator().manual_seed(c.seed)
        lengths = torch.exp(torch.randn(c.size, generator=gen, dtype=torch.float64) * c.prompt_sigma)
        self._lengths = (lengths * c.prompt_tokens).round().clamp(min=1).to(torch.int64).tolist()
        self._ids = torch.randint(0, c.vocab_size, (max(self._lengths),), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> PromptRecord:
        if not 0 <= index < len(self._lengths):
            raise IndexError(f"record {index} out of range for {len(self._lengths)} records")
        n = self._lengths[index]
        return PromptRecord(index=index, prompt=f"sim-{index}", prompt_token_ids=tuple(self._ids[:n]))


class SimRewardConfig(BaseModel):
    """Options of the ``sim`` reward."""

    model_config = ConfigDict(extra="forbid")

    p_correct: float = Field(0.5, ge=0, le=1, description="Probability that a sample scores 1.")
    seed: int = Field(0, description="Seed mixed into each sample's draw.")
    seconds_per_sample: float = Field(
        0.0, ge=0, description="Modelled scoring time per sample, spent once per batch on the loop's clock (a "
        "verifier's cost, or the driver's per-sample work: asyncflow sim --calibrate charges what a synchronous "
        "run's engine spans leave unexplained here). 0: free.")
    machine: SimHostShare | None = Field(
        None, description="Share a simulated machine's cores with the sim engines that name the same host while "
        "scoring (processor sharing; docs/simulation.md). None: scoring slows nothing.")


class SimReward(Reward):
    """1 with probability ``p_correct``, a deterministic function of the completion's tokens; reads no text."""

    needs_text = False
    #: synchronous and free: a run scores it in the rollout stage's write, with no reward stage (the inline reward,
    #: flow/reward_inline.py; the same schedule and rewards). With seconds_per_sample > 0 it scores batches
    #: (score_many), so the reward stage keeps it and its modelled time overlaps rollout.
    local = True

    def __init__(self, config: SimRewardConfig | None = None) -> None:
        self.config = config or SimRewardConfig()

    @property
    def score_many(self) -> Any:
        """Batch scoring, only when scoring costs time: the reward stage then awaits one sleep per batch (an
        event per batch, not per sample); free scoring keeps the plain per-sample path (AttributeError here)."""
        if self.config.seconds_per_sample <= 0:
            raise AttributeError("score_many")
        return self._score_many

    def score(self, sample: RewardInput) -> float:
        key = f"{self.config.seed}:{sample.prompt}:{len(sample.completion_token_ids)}:{sample.metadata.get('i', '')}"
        u = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2.0**64
        return float(u < self.config.p_correct)

    async def _score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        seconds = self.config.seconds_per_sample * len(samples)
        share = self.config.machine
        if share is None:
            await asyncio.sleep(seconds)
        else:
            await host_for(share).spend(seconds, share.demand, thread=share.thread)
        return [(True, self.score(s)) for s in samples]
