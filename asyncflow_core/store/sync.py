"""A blocking facade over any :class:`StreamStore`, for code that is not async (e.g. a reward worker thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar



from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.types import Batch, Column

T = TypeVar("T")


class SyncStore:
    """The :class:`StreamStore` API with plain (blocking) methods.

    Each call runs the store's coroutine on ``loop`` when given (the loop the
    store lives on, e.g. the main loop of a runtime: use this for stores that
    are bound to one loop) or else on a private event loop in a daemon
    thread. The in-process store accepts calls from any loop, so a reward
    thread can share it with async code through ``SyncStore(store)``.

    ``close()`` closes the store; ``shutdown()`` only stops the private loop.
    Usable as a context manager (closes the store and stops the loop).
    """

    def __init__(self, store: StreamStore, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.store = store
        self._own_loop = loop is None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread: threading.Thread | None = threading.Thread(
                target=loop.run_forever, name="asyncflow-sync-store", daemon=True
            )
            self._thread.start()
        else:
            self._thread = None
        self._loop = loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("SyncStore was shut down; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def features(self):
        return self.store.features

    def register_task(self, task: str, *, consumes: Sequence[str] = (), produces: Sequence[str] = (),
                      partition: str | None = None) -> None:
        """See :meth:`StreamStore.register_task`."""
        kw = {} if partition is None else {"partition": partition}  # stores predating task scopes take no such kw
        return self._run(self.store.register_task(task, consumes=consumes, produces=produces, **kw))

    def put(self, columns: Mapping[str, Column], **kwargs: Any) -> BatchMeta:
        """See :meth:`StreamStore.put` (same keyword arguments)."""
        return self._run(self.store.put(columns, **kwargs))

    def get_meta(self, task: str, columns: Sequence[str], batch_size: int, **kwargs: Any) -> BatchMeta:
        """See :meth:`StreamStore.get_meta` (same keyword arguments); blocks this thread while it waits."""
        return self._run(self.store.get_meta(task, columns, batch_size, **kwargs))

    def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        """See :meth:`StreamStore.get`."""
        return self._run(self.store.get(meta, columns))

    def ack(self, meta: BatchMeta) -> None:
        """See :meth:`StreamStore.ack`."""
        return self._run(self.store.ack(meta))

    def release(self, meta: BatchMeta) -> None:
        """See :meth:`StreamStore.release`."""
        return self._run(self.store.release(meta))

    def renew(self, meta: BatchMeta, *, lease_s: float | None = None) -> float | None:
        """See :meth:`StreamStore.renew`."""
        return self._run(self.store.renew(meta, lease_s=lease_s))

    def declare_dead(self, consumer: str) -> int:
        """See :meth:`StreamStore.declare_dead`."""
        return self._run(self.store.declare_dead(consumer))

    def end_stream(self, partition: str | None = None) -> None:
        """See :meth:`StreamStore.end_stream`."""
        return self._run(self.store.end_stream(partition))

    def clear(self, partition: str | None = None) -> int:
        """See :meth:`StreamStore.clear`."""
        return self._run(self.store.clear(partition))

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`StreamStore.state_dict`."""
        return self._run(self.store.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`StreamStore.load_state_dict`."""
        return self._run(self.store.load_state_dict(state))

    def stats(self) -> dict[str, int]:
        """See :meth:`StreamStore.stats`."""
        return self._run(self.store.stats())

    def close(self) -> None:
        """Close the store (waking its waiters with ``StoreClosedError``), then stop the private loop."""
        try:
            self._run(self.store.close())
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the private loop thread (the store stays open). Safe to call twice."""
        if self._own_loop and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SyncStore"]
