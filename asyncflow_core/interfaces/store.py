"""The StreamStore contract: the column-oriented streaming store (TransferQueue)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.interfaces.features import StoreFeatures
from asyncflow_core.types import Batch, Column


@dataclass(frozen=True)
class BatchMeta:
    """A handle on rows of the store: what ``get_meta`` leases and ``put`` returns.

    ``lease_id`` is set for leases (rows handed to ``task``); it is ``None``
    for the handle ``put`` returns. ``end_of_stream`` is True on the (empty)
    meta returned once the stream has ended and no row will ever become ready
    for the request.
    """

    row_ids: torch.Tensor  #: int64 global row indices
    columns: tuple[str, ...] = ()
    task: str | None = None
    lease_id: int | None = None
    deadline: float | None = None  #: monotonic time after which an unacknowledged lease returns to free
    group_ids: torch.Tensor | None = None
    min_version: torch.Tensor | None = None
    max_version: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    end_of_stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return int(self.row_ids.numel())

    @classmethod
    def _trusted(cls, **values: Any) -> BatchMeta:
        """Internal: ``BatchMeta(**values)`` (this dataclass checks nothing) without a frozen dataclass's
        ``object.__setattr__`` per field; the store builds one per put and per lease. Fields left out take
        their defaults."""
        out = object.__new__(cls)
        d = out.__dict__
        d.update(_META_DEFAULTS)
        d["extra"] = {}
        d.update(values)
        return out


#: BatchMeta's field defaults (``extra``'s factory aside), for :meth:`BatchMeta._trusted`
_META_DEFAULTS = {f.name: f.default for f in fields(BatchMeta) if f.default is not MISSING}


class StreamStore(abc.ABC):
    """Rows are samples, columns are fields; every RL task reads and writes it sample by sample.

    Per row the store keeps a ready bit per column and, per consuming task,
    a state: free -> leased -> done. Guarantees every deployment gives:

    - **Exactly once per task**: a row is leased to a task only while free for
      it; after ``ack`` it is done for that task and never handed out to it again.
    - **Nothing lost**: ``release``, an expired lease deadline, or a consumer
      declared dead return the rows to free.
    - **Version filter**: ``get_meta(min_version=v)`` never returns a row whose
      ``min_version`` is below ``v``.
    - **Streaming**: ``get_meta`` returns as soon as the sampler forms a batch;
      waits are notification-driven, never polling sleeps.
    - **Backpressure**: at most ``capacity`` rows are live; ``put`` of new rows
      waits for space (``block=True``) or raises ``StoreFullError``.

    Errors are typed subclasses of :class:`~asyncflow_core.errors.StoreError`;
    a rejected call leaves the store unchanged.
    """

    @property
    @abc.abstractmethod
    def features(self) -> StoreFeatures:
        """Deployment and optional capabilities (see :class:`StoreFeatures`)."""

    @abc.abstractmethod
    async def register_task(
        self, task: str, *, consumes: Sequence[str] = (), produces: Sequence[str] = (), partition: str | None = None
    ) -> None:
        """Declare a task: the columns it reads (it becomes a consumer that must
        acknowledge every row of its scope before the row can be garbage-collected)
        and the columns it writes. ``get_meta`` for a column no task produces raises
        ``UnknownColumnError``.

        ``partition`` scopes the task to one partition (default: every
        partition): its ``get_meta(partition=None)`` sees only that partition's
        rows (naming another raises ``InvalidRequestError``), its end of stream
        is that partition's, and a row is collected once every consumer task
        of its partition (scoped to it or unscoped) acknowledged it.
        Re-registering keeps the scope; naming a different one raises
        ``InvalidRequestError``."""

    @abc.abstractmethod
    async def put(
        self,
        columns: Mapping[str, Column],
        *,
        rows: BatchMeta | None = None,
        partition: str = "default",
        group_ids: torch.Tensor | Sequence[int] | None = None,
        versions: torch.Tensor | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Write column values.

        With ``rows=None`` new rows are appended (one per row of ``columns``)
        to ``partition`` with the given ``group_ids``; otherwise the columns
        of the existing ``rows`` are written. ``versions`` ([n, 2] int64: min
        and max policy version per row) widens each row's version range. Each
        written column's ready bit is set atomically with its data. Returns a
        meta naming the rows written.
        """

    @abc.abstractmethod
    async def get_meta(
        self,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: str | None = None,
        min_version: int | None = None,
        partition: str | None = None,
        partial: bool = False,
        timeout: float | None = None,
        lease_s: float | None = None,
        consumer: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> BatchMeta:
        """Lease up to ``batch_size`` rows whose ``columns`` are ready, free for ``task``, and inside the filter.

        Blocks until the sampler forms a batch, the stream ends (returns an
        empty meta with ``end_of_stream=True``), or ``timeout`` passes
        (raises ``StoreTimeoutError``). ``consumer`` names the holder so
        ``declare_dead`` can return its leases.
        """

    @abc.abstractmethod
    async def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        """Read ``columns`` (default: ``meta.columns``) of ``meta``'s rows, in ``meta`` order, with ``row_ids`` set.

        The batch is read-only and may share memory with the store (clone a tensor before writing it in place);
        it keeps the values it was read with for as long as it is referenced, whatever happens to its rows
        afterwards (ack, collection, clear, overwrite): a store never writes memory a batch it handed out still
        sees (docs/store.md, "What get returns")."""

    @abc.abstractmethod
    async def ack(self, meta: BatchMeta) -> None:
        """Mark a lease's rows done for its task. A second ack, or an ack after the lease expired, raises ``LeaseError``.

        A deployment may send an ack without waiting for its reply when the handle holds the lease and can vouch
        for it (``ray``: got by this handle, not ended, a second or more left). A failure the handle could not
        foresee (another handle freed the lease with ``declare_dead`` or ``clear`` meanwhile) is then raised by the
        handle's next call, which does nothing else, or by ``close``; it is never lost. The handle's own later
        calls always see the ack applied."""

    @abc.abstractmethod
    async def release(self, meta: BatchMeta) -> None:
        """Return a lease's rows to free for its task without processing them."""

    async def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        """Keep a lease: push its deadline to now + ``lease_s`` (default: the ``lease_s`` it was granted with).

        Returns the new deadline (the store's monotonic clock, like
        ``meta.deadline``), or ``None`` when the lease is no longer held:
        acknowledged, released, expired, freed by ``declare_dead`` or
        ``clear``, or held before ``load_state_dict``. ``None`` is an
        answer, not an error: the rows may already be leased to someone
        else, so stop working on them (their ``ack`` raises ``LeaseError``).
        A meta that is not a lease raises ``LeaseError``.

        Optional: a store that does not renew leaves this default, which
        raises :class:`~asyncflow_core.errors.UnsupportedFeatureError`, and
        declares ``features.supports_lease_renewal = False``.
        """
        raise UnsupportedFeatureError(
            f"{type(self).__name__} cannot renew leases (features.supports_lease_renewal is False); lease with a "
            "lease_s longer than the work on the rows takes"
        )

    @abc.abstractmethod
    async def declare_dead(self, consumer: str) -> int:
        """Return every lease held by ``consumer`` to free; returns the number of rows freed."""

    @abc.abstractmethod
    async def end_stream(self, partition: str | None = None) -> None:
        """No more new rows will be put (in ``partition``, or at all): consumers drain then get ``end_of_stream``."""

    @abc.abstractmethod
    async def clear(self, partition: str | None = None) -> int:
        """Drop rows (of ``partition``, or all) and their leases; returns the number of rows dropped."""

    @abc.abstractmethod
    async def state_dict(self) -> dict[str, Any]:
        """Controller state (rows, readiness, per-task progress, data) to resume from."""

    @abc.abstractmethod
    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; outstanding leases come back as free."""

    @abc.abstractmethod
    async def stats(self) -> dict[str, int]:
        """Counters: rows live, rows leased, rows done, rows dropped, bytes stored (at least these keys)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving; wake every waiter with ``StoreClosedError``. Safe to call twice."""
