"""The RolloutEngine contract: produce completions with per-token log-probs."""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.interfaces.features import RolloutFeatures
from asyncflow_core.types import GenerationRequest, GenerationResult, WeightBucket

if TYPE_CHECKING:
    from asyncflow_core.types.adapter import LoraSpec


class PauseMode(str, enum.Enum):
    """What happens to in-flight requests on :meth:`RolloutEngine.pause`."""

    ABORT = "abort"  #: abort them (results with finish reason ``abort`` come out of ``generate``)
    KEEP = "keep"  #: hold them where they are, KV cache included, until ``resume``
    WAIT = "wait"  #: stop admitting new requests and return once the in-flight ones finish


class KVCachePolicy(str, enum.Enum):
    """What an in-flight weight update does to cached keys/values of held requests."""

    KEEP = "keep"  #: keep the cache computed by the old weights (cheaper; slightly off-policy prefix)
    RECOMPUTE = "recompute"  #: recompute the prefix with the new weights before continuing


class Health(BaseModel):
    """A backend's answer to ``health()``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool = Field(description="True when the backend can serve requests.")
    detail: str = Field("", description="Why not, or anything worth showing an operator.")
    in_flight: int = Field(0, description="Requests or tasks currently being worked on.")


class RolloutEngine(abc.ABC):
    """An inference engine serving one policy replica.

    Lifecycle: ``start()`` once, then any of the methods below from one event
    loop, then ``shutdown()``. Methods may be called concurrently from
    different tasks of that loop (e.g. ``abort`` while ``generate`` streams).
    """

    @property
    @abc.abstractmethod
    def features(self) -> RolloutFeatures:
        """What optional capabilities this engine has (see :class:`RolloutFeatures`)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights that new tokens are sampled with.

        Starts at the version the engine was loaded with (0 for fresh
        weights) and changes only inside :meth:`update_weights`.
        """

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and get ready to serve. Idempotent is not required.

        Raises :class:`~asyncflow_core.errors.EngineError` with the reason when
        the model cannot be loaded.
        """

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Complete ``requests``, yielding each result as soon as it finishes.

        - Order: results come in completion order, not request order; every
          request yields exactly one result (including aborted or failed ones).
        - ``token_ids`` / ``logprobs`` / ``versions`` are aligned per token;
          log-probs follow the convention in :class:`SamplingParams`.
        - A request that fails alone yields ``finish_reason=ERROR`` with
          ``error`` set; it does not end the iterator. An engine-wide failure
          raises :class:`~asyncflow_core.errors.EngineError` out of the iterator.
        - Requests aborted through :meth:`abort` or ``pause(ABORT)`` come out
          here with ``finish_reason=ABORT`` and the tokens generated so far.
        - A duplicate ``request_id`` among in-flight requests raises
          ``ValueError`` before anything is generated.
        """

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str] | None = None) -> list[str]:
        """Abort the named in-flight requests (all of them when ``None``).

        Returns the ids that were actually aborted (unknown or already finished
        ids are ignored). Their partial results are delivered by the
        ``generate`` iterator that owns them, with ``finish_reason=ABORT``,
        before that iterator ends — one result per request, in one place.

        Raises ``UnsupportedFeatureError`` unless ``features.supports_abort``.
        """

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Stop generating; requests submitted while paused wait for :meth:`resume`.

        ``KEEP`` needs ``features.supports_pause_keep`` and ``ABORT`` needs
        ``features.supports_pause_abort``; otherwise ``UnsupportedFeatureError``.
        Returns once the engine is quiescent (no token is sampled until resume).
        """

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after :meth:`pause`. A no-op when not paused."""

    @abc.abstractmethod
    async def update_weights(
        self,
        version: int,
        buckets: AsyncIterable[WeightBucket],
        *,
        kv_cache: KVCachePolicy = KVCachePolicy.RECOMPUTE,
    ) -> None:
        """Load a published weight version, bucket by bucket, in place.

        Safe-point semantics: when not paused, the engine applies the update
        between decoding steps — no token is sampled from a mix of versions,
        and every token sampled after this returns carries ``version``. When
        paused with requests held (``features.supports_inflight_weight_update``)
        the held requests continue on the new weights after ``resume`` with the
        declared ``kv_cache`` policy. Buckets are verified (``bucket.verify()``)
        before use; a bad bucket raises
        :class:`~asyncflow_core.errors.WeightTransferError` and leaves the old
        weights and ``version`` in force. Prefix caches are reset.
        """

    def configure_adapter(self, spec: LoraSpec) -> None:
        """Declare that the trainer trains a LoRA adapter of ``spec`` and publishes adapter-only updates.

        Called once per engine object, before :meth:`start` (an engine that
        fixes its LoRA capacity when it loads, like vLLM's ``enable_lora`` /
        ``max_lora_rank``, needs it then); engines that can may also accept
        it after ``start`` but before the first :meth:`update_weights`.
        After it, :meth:`update_weights` takes either

        - an adapter-only update: a partial update (see
          :func:`~asyncflow_core.types.collect_update`) carrying exactly the
          adapter's tensors, named as ``peft.get_peft_model_state_dict``
          names them (``base_model.model.<module>.lora_A.weight`` ..., and
          the ``modules_to_save`` weights); the version's policy is the base
          weights plus that adapter, never an accumulation of earlier ones; or
        - a full update of the base model (optionally with the adapter's
          tensors too): the base weights change, and the adapter is the one
          sent, or none (a zero delta) when none is sent.

        Either way the engine's :attr:`version` becomes the update's version
        only when the update was applied (a refused update changes nothing),
        so the per-token ``versions`` of a result are the adapter versions
        that sampled the tokens. Log-probs stay in the convention of
        :class:`~asyncflow_core.types.SamplingParams`.

        Raises :class:`~asyncflow_core.errors.UnsupportedFeatureError` unless
        ``features.supports_adapter_updates``; ``ConfigError`` when the spec
        does not fit the engine (e.g. a rank above what it was started with).
        """
        raise UnsupportedFeatureError(
            f"the {type(self).__name__} rollout engine does not apply LoRA adapter updates "
            "(supports_adapter_updates=False); train the full model (unset trainer.lora) or use an engine that does"
        )

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None:
        """Release device memory for a colocated trainer (level 1: keep weights on host; 2: drop them).

        Raises ``UnsupportedFeatureError`` unless ``features.supports_sleep``.
        """

    @abc.abstractmethod
    async def wake_up(self) -> None:
        """Undo :meth:`sleep`. Raises ``UnsupportedFeatureError`` unless ``features.supports_sleep``."""

    @abc.abstractmethod
    async def health(self) -> Health:
        """Report liveness cheaply (called by heartbeats; must not block on generation)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort anything in flight, free resources. Safe to call twice."""
