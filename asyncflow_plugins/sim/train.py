"""``sim`` train engine: spends the modelled time of each step on the loop's clock, moves no real weights."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core import columns as C
from asyncflow_core.errors import EngineError
from asyncflow_core.interfaces import Algorithm, TrainEngine, TrainFeatures
from asyncflow_core.types import Batch, RaggedTensor, WeightBucket, pack_buckets
from asyncflow_plugins.sim.host import SimHostShare, host_for
from asyncflow_plugins.sim.latency import TrainLatency
from asyncflow_plugins.sim.policy import token_logprobs

FEATURES = TrainFeatures(
    supports_values=True, supports_checkpoint=True, supports_hf_export=False, weight_transports=("sim", "inprocess")
)

#: Name of the one real tensor a sim export carries (the version stamp).
VERSION_TENSOR = "sim.version"


class SimTrainConfig(BaseModel):
    """Options of the ``sim`` train engine."""

    model_config = ConfigDict(extra="forbid")

    latency: TrainLatency = Field(default_factory=TrainLatency, description="Cost model of the trainer group.")
    policy_seed: int = Field(0, description="Seed of the simulated policy's log-probs (use the sim rollout's).")
    vocab_size: int = Field(32000, ge=2, description="Vocabulary of the simulated policy (use the sim rollout's).")
    time_scale: float = Field(
        1.0, gt=0, description="Loop seconds per modelled second; < 1 makes runs on a real event loop fast (tests)."
    )
    machine: SimHostShare | None = Field(
        None, description="Share a simulated machine's cores with the other sim engines that name the same host "
        "(processor sharing; docs/simulation.md). None: the trainer has its own devices.")


@dataclass
class SimTrainStats:
    """Counters of the trainer (modelled seconds, not multiplied by ``time_scale``)."""

    busy_seconds: float = 0.0  #: train steps, forward passes and checkpoints
    train_seconds: float = 0.0
    forward_seconds: float = 0.0
    steps: int = 0
    train_tokens: int = 0
    forward_tokens: int = 0


class SimTrainEngine(TrainEngine):
    """A simulated trainer group: ``train_step`` costs ``TrainLatency.train_time(tokens)`` and bumps the version.

    Log-probs come from the simulated policy shared with the sim rollout
    engine, so behaviour and trainer log-probs agree at equal versions.
    Exports carry one tiny real tensor (the version) packed with
    :func:`pack_buckets`, so checksums are real; the *nominal* size a
    transport should model is :attr:`model_bytes`.
    """

    def __init__(self, config: SimTrainConfig | None = None) -> None:
        self.config = config or SimTrainConfig()
        self._lat = self.config.latency
        self.stats = SimTrainStats()
        self._version = 0
        self._ready = False
        self._exporting = False

    @property
    def features(self) -> TrainFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    @property
    def devices(self) -> int:
        """Accelerators of the trainer group."""
        return self._lat.devices

    @property
    def busy_seconds(self) -> float:
        """Modelled seconds spent in train steps, forward passes and checkpoints."""
        return self.stats.busy_seconds

    @property
    def model_bytes(self) -> float:
        """Nominal bytes of one weight version (bf16), what a transport should model moving."""
        return 2.0 * self._lat.params

    async def setup(self) -> None:
        self._ready = True

    def _check(self) -> None:
        if not self._ready:
            raise EngineError("call setup() before using the sim train engine")

    async def _spend(self, seconds: float) -> None:
        share = self.config.machine
        if share is None:
            await asyncio.sleep(seconds * self.config.time_scale)
        else:  # the work takes longer while other engines run on the host
            await host_for(share).spend(seconds, share.demand, self.config.time_scale, thread=share.thread)
        self.stats.busy_seconds += seconds

    def _logprobs(self, batch: Batch) -> RaggedTensor:
        resp = batch[C.RESPONSE_IDS]
        if not isinstance(resp, RaggedTensor):
            raise ValueError(f"{C.RESPONSE_IDS} must be a ragged column, got a dense tensor")
        values = token_logprobs(
            resp.values, self._version, policy_seed=self.config.policy_seed, vocab_size=self.config.vocab_size
        )
        return RaggedTensor(values, resp.offsets)

    async def compute_logprobs(self, batch: Batch, *, values: bool = False) -> Batch:
        self._check()
        _require(batch, (C.PROMPT_IDS, C.RESPONSE_IDS))
        tokens = _tokens(batch)
        # a critic forward is a second model of the same size
        seconds = self._lat.forward_time(tokens) * (2 if values else 1)
        await self._spend(seconds)
        self.stats.forward_seconds += seconds
        self.stats.forward_tokens += tokens
        logp = self._logprobs(batch)
        out = {C.LOGPROBS: logp}
        if values:
            out[C.VALUES] = RaggedTensor(torch.zeros_like(logp.values), logp.offsets)
        return batch.with_columns(**out)

    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        self._check()
        if self._exporting:
            raise EngineError("train_step called while export_weights is running; finish the export first")
        _require(batch, (C.PROMPT_IDS, C.RESPONSE_IDS, *algorithm.required_columns))
        tokens = _tokens(batch)
        seconds = self._lat.train_time(tokens)
        await self._spend(seconds)
        self.stats.train_seconds += seconds
        self.stats.steps += 1
        self.stats.train_tokens += tokens
        self._version += 1
        step = self._version
        flops = 6.0 * self._lat.params * tokens
        return {
            # plausible, smooth, deterministic curves: nothing is learnt
            "loss": 0.5 * math.exp(-step / 200.0) + 0.02 * math.sin(step),
            "grad_norm": 0.3 + 0.7 * math.exp(-step / 100.0),
            "sim/step_seconds": seconds,
            "sim/tokens": float(tokens),
            "sim/sequences": float(batch.num_rows),
            "sim/mfu": flops / (seconds * self._lat.devices * self._lat.peak_flops_per_device) if seconds else 0.0,
        }

    async def export_weights(self, *, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        self._check()
        self._exporting = True
        try:
            stamp = torch.tensor([self._version], dtype=torch.int64)
            for bucket in pack_buckets([(VERSION_TENSOR, stamp)], version=self._version, bucket_bytes=bucket_bytes):
                yield bucket
        finally:
            self._exporting = False

    async def save(self, path: Path) -> None:
        self._check()
        await self._spend(self._lat.checkpoint_s)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sim_trainer.json").write_text(json.dumps({"version": self._version}))

    async def load(self, path: Path) -> None:
        self._check()
        file = Path(path) / "sim_trainer.json"
        if not file.exists():
            raise EngineError(f"no sim trainer checkpoint at {file}; give the directory save() wrote")
        await self._spend(self._lat.checkpoint_s)
        self._version = int(json.loads(file.read_text())["version"])

    async def shutdown(self) -> None:
        self._ready = False


def _tokens(batch: Batch) -> int:
    total = 0
    for name in (C.PROMPT_IDS, C.RESPONSE_IDS):
        col = batch[name]
        total += col.numel_packed if isinstance(col, RaggedTensor) else int(col.numel())
    return total


def _require(batch: Batch, names: tuple[str, ...]) -> None:
    missing = [n for n in dict.fromkeys(names) if n not in batch]
    if missing:
        raise ValueError(f"batch lacks columns {missing}; it has {sorted(batch.columns)}")
