"""The TrainEngine contract: a model replica group plus its optimizer."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from pathlib import Path

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.interfaces.algorithm import Algorithm
from asyncflow_core.interfaces.features import TrainFeatures
from asyncflow_core.types import Batch, WeightBucket


class TrainEngine(abc.ABC):
    """Owns the trainable policy (sharded over its ranks) and its optimizer.

    Batches carry at least ``prompt_ids`` and ``response_ids`` (ragged); the
    engine scores the response tokens given their prompt. All methods are
    called from one event loop, one at a time (the runtime serialises them).
    """

    @property
    @abc.abstractmethod
    def features(self) -> TrainFeatures:
        """Optional capabilities (see :class:`TrainFeatures`)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Number of optimizer steps taken since version 0 (the initial weights).

        Incremented by exactly 1 by each successful :meth:`train_step`;
        restored by :meth:`load`.
        """

    @abc.abstractmethod
    async def setup(self) -> None:
        """Build or load the model and optimizer (and start ranks, if distributed).

        Raises :class:`~asyncflow_core.errors.EngineError` with the reason on failure.
        """

    @abc.abstractmethod
    async def compute_logprobs(self, batch: Batch, *, values: bool = False) -> Batch:
        """Forward only: log-probs of ``response_ids`` given ``prompt_ids`` under the current weights.

        Returns a batch with a ragged float32 ``logprobs`` column aligned with
        ``response_ids`` (and ``values`` when ``values=True``, which needs
        ``features.supports_values``, else ``UnsupportedFeatureError``). Uses
        the log-prob convention of :class:`~asyncflow_core.types.SamplingParams`
        with the temperature given in the engine's config. Does not change
        the weights or :attr:`version`.
        """

    @abc.abstractmethod
    async def train_step(self, batch: Batch, algorithm: Algorithm) -> dict[str, float]:
        """One optimizer step over ``batch`` (split into micro-batches as configured).

        The loss is ``algorithm.loss`` summed over micro-batches so that the
        result equals the loss of the whole batch (the algorithm's
        :class:`~asyncflow_core.interfaces.algorithm.LossContext` carries the
        global token and sequence counts). Returns scalar metrics (at least
        ``loss`` and ``grad_norm``) and increments :attr:`version` by 1.
        Raises ``ValueError`` naming the missing columns when ``batch`` lacks
        any of ``algorithm.required_columns``; the weights are then unchanged.
        """

    @abc.abstractmethod
    def export_weights(self, *, bucket_bytes: int) -> AsyncIterator[WeightBucket]:
        """Yield the full (unsharded) weights of :attr:`version` in buckets.

        Tensor names are the Hugging Face parameter names the rollout engines
        load. Buckets come in index order, the last one has ``last=True``, each
        carries its checksum. Weights must not change while the iterator runs.

        With LoRA on (``features.supports_lora`` and a ``lora`` option, see
        :mod:`asyncflow_core.types.adapter`), version 0 is the whole base model
        and every later version carries only the adapter's tensors (peft
        state-dict names), received with ``collect_update(..., partial=names)``.
        """

    @abc.abstractmethod
    async def save(self, path: Path) -> None:
        """Write a resumable checkpoint (model, optimizer, version, RNG) under ``path``."""

    @abc.abstractmethod
    async def load(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save`; :attr:`version` is restored too."""

    async def export_pretrained(self, path: Path) -> None:
        """Write the current weights as a Hugging Face checkpoint (``config.json`` + safetensors) under ``path``.

        Lets any other tool load the trained policy. Optional: engines
        without a Hugging Face model raise ``UnsupportedFeatureError``.
        """
        raise UnsupportedFeatureError(f"{type(self).__name__} cannot export a Hugging Face checkpoint")

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Free resources and stop ranks. Safe to call twice."""
