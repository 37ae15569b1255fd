"""``toy`` train engine: the bigram policy trained with Adam, micro-batched by tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core import columns as C
from asyncflow_core.errors import EngineError, UnsupportedFeatureError
from asyncflow_core.interfaces import Algorithm, LossContext, TrainEngine, TrainFeatures
from asyncflow_core.types import Batch, RaggedTensor, WeightBucket, pack_buckets
from asyncflow_core.types.adapter import LoraSpec
from asyncflow_plugins.toy.policy import PARAM_NAME, initial_table, sampling_logprobs

FEATURES = TrainFeatures(supports_values=False, supports_checkpoint=True, supports_hf_export=False)


class ToyTrainConfig(BaseModel):
    """Options of the ``toy`` train engine."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(16, ge=2, description="Vocabulary size of the bigram table.")
    seed: int = Field(0, description="Seed of the version-0 table (match the rollout engine's).")
    init_scale: float = Field(1.0, ge=0, description="Std of the random version-0 logits.")
    lr: float = Field(0.05, gt=0, description="Adam learning rate.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    temperature: float = Field(1.0, gt=0, description="Temperature of the log-prob convention (match the rollout's).")
    micro_batch_tokens: int = Field(4096, ge=1, description="Response-token budget of one micro-batch.")
    lora: LoraSpec | None = Field(
        None, description="Filled from trainer.lora; the bigram table is no Hugging Face model, so LoRA is refused."
    )

    def exported_weights(self, model: object = None) -> dict[str, tuple[int, ...]]:
        """What ``export_weights`` sends: the bigram table (for ``asyncflow config validate``'s pairing check)."""
        return {PARAM_NAME: (self.vocab_size, self.vocab_size)}


def response_logprobs(table: torch.Tensor, prompt_ids: RaggedTensor, response_ids: RaggedTensor, temperature: float) -> RaggedTensor:
    """Log-probs of every response token given the previous token, vectorised over the packed batch."""
    vocab = table.shape[0]
    for name, ids in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        if ids.numel_packed and (int(ids.values.min()) < 0 or int(ids.values.max()) >= vocab):
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab})")
    if bool((prompt_ids.lengths == 0).any()):
        raise ValueError("every row needs a non-empty prompt")
    resp = response_ids.values
    prev = torch.roll(resp, 1)
    starts = response_ids.offsets[:-1]
    nonempty = response_ids.lengths > 0
    last_prompt = prompt_ids.values[prompt_ids.offsets[1:] - 1]
    prev[starts[nonempty]] = last_prompt[nonempty]
    logp = sampling_logprobs(table[prev], temperature)
    return RaggedTensor(logp.gather(1, resp.unsqueeze(1)).squeeze(1), response_ids.offsets)


def micro_batches(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Split row indices into consecutive micro-batches of at most ``budget`` tokens (a longer row goes alone)."""
    out: list[torch.Tensor] = []
    start, used = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if i > start and used + n > budget:
            out.append(torch.arange(start, i))
            start, used = i, 0
        used += n
    if start < lengths.numel():
        out.append(torch.arange(start, lengths.numel()))
    return out


class ToyTrainEngine(TrainEngine):
    """One process, one rank: enough to run the whole pipeline and the spec suite on a laptop."""

    def __init__(self, config: ToyTrainConfig) -> None:
        if config.lora is not None:
            raise UnsupportedFeatureError("trainer.lora: the toy trainer's bigram table has no linear layers to adapt; "
                                          "remove trainer.lora, or use the fsdp trainer with a Hugging Face model")
        self.config = config
        self._param: torch.nn.Parameter | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._version = 0
        self._exporting = False

    @property
    def features(self) -> TrainFeatures:
        return FEATURES

    @property
    def version(self) -> int:
        return self._version

    async def setup(self) -> None:
        c = self.config
        self._param = torch.nn.Parameter(initial_table(c.vocab_size, c.seed, c.init_scale))
        self._opt = torch.optim.Adam([self._param], lr=c.lr)

    def _ready(self) -> torch.nn.Parameter:
        if self._param is None:
            raise EngineError("call setup() before using the toy train engine")
        return self._param

    async def compute_logprobs(self, batch: Batch, *, values: bool = False) -> Batch:
        param = self._ready()
        if values:
            raise UnsupportedFeatureError("the toy train engine has no value head (supports_values=False)")
        _require(batch, (C.PROMPT_IDS, C.RESPONSE_IDS))
        with torch.no_grad():
            logp = response_logprobs(param, batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], self.config.temperature)
        return batch.with_columns(**{C.LOGPROBS: logp})

    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        param = self._ready()
        if self._exporting:
            raise EngineError("train_step called while export_weights is running; finish the export first")
        _require(batch, (C.PROMPT_IDS, C.RESPONSE_IDS, C.ADVANTAGES, *algorithm.required_columns))
        assert self._opt is not None
        resp: RaggedTensor = batch[C.RESPONSE_IDS]  # type: ignore[assignment]
        ctx = LossContext.of(batch, self._version)  # counts only unmasked tokens under a loss_mask column
        self._opt.zero_grad(set_to_none=True)
        total = 0.0
        sums: dict[str, float] = {}
        parts = micro_batches(resp.lengths, self.config.micro_batch_tokens)
        for index in parts:
            mb = batch.select(index)
            logp = response_logprobs(param, mb[C.PROMPT_IDS], mb[C.RESPONSE_IDS], self.config.temperature)
            loss, metrics = algorithm.loss(logp, mb, ctx)
            loss.backward()
            total += float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            await asyncio.sleep(0)  # let other stages run between micro-batches
        grad_norm = torch.nn.utils.clip_grad_norm_([param], self.config.max_grad_norm)
        self._opt.step()
        self._version += 1
        out = {f"algo/{k}": v / len(parts) for k, v in sums.items()}
        out.update(loss=total, grad_norm=float(grad_norm), micro_batches=float(len(parts)))
        return out

    async def export_weights(self, *, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        param = self._ready()
        self._exporting = True
        try:
            for bucket in pack_buckets([(PARAM_NAME, param.detach())], version=self._version, bucket_bytes=bucket_bytes):
                yield bucket
        finally:
            self._exporting = False

    async def save(self, path: Path) -> None:
        param = self._ready()
        assert self._opt is not None
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"weight": param.detach().clone(), "optimizer": self._opt.state_dict(), "version": self._version},
            path / "toy_trainer.pt",
        )

    async def load(self, path: Path) -> None:
        param = self._ready()
        assert self._opt is not None
        file = Path(path) / "toy_trainer.pt"
        if not file.exists():
            raise EngineError(f"no toy trainer checkpoint at {file}; give the directory save() wrote")
        state = torch.load(file, weights_only=True)
        with torch.no_grad():
            param.copy_(state["weight"])
        self._opt.load_state_dict(state["optimizer"])
        self._version = int(state["version"])

    async def shutdown(self) -> None:
        self._param = None
        self._opt = None


def _require(batch: Batch, names: tuple[str, ...]) -> None:
    missing = [n for n in dict.fromkeys(names) if n not in batch]
    if missing:
        raise ValueError(f"batch lacks columns {missing}; it has {sorted(batch.columns)}")
