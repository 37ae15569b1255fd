"""Keeping a lease while its rows are worked on for longer than one lease.

A consumer that holds rows for an unknown time (an agentic episode: turns,
tool calls, environment steps) asks the store to push its lease's deadline
forward as it goes. :class:`LeaseKeeper` makes that cheap enough to call on
every turn: it asks the store only once half the lease has passed since the
lease was granted or last renewed, and episodes that share one lease share
its renewals (one store call however many of them ask at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.interfaces.store import BatchMeta, StreamStore
from asyncflow_core.store.errors import InvalidRequestError

log = logging.getLogger("asyncflow.store")

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Renews one lease (``meta``, granted for ``lease_s`` seconds) when half of it has passed.

    Make it right after ``get_meta`` returned ``meta`` with the same
    ``lease_s``, and call :meth:`renew` whenever convenient (once per turn of
    an episode): below half the lease it reads ``clock`` and returns. ``clock``
    measures the time since the last grant; it must not run slower than the
    store's (the run's event-loop clock, or ``time.monotonic``, the clock of
    the out-of-process stores). ``fraction`` is the share of the lease after
    which a call renews.

    A store without renewal (``features.supports_lease_renewal`` off) is told
    once, logged once, and never asked again: :meth:`renew` then answers True
    and the lease lasts what it was granted for.
    """

    def __init__(
        self, store: StreamStore, meta: BatchMeta, lease_s: float, *,
        clock: Callable[[], float] = time.monotonic, fraction: float = 0.5,
    ) -> None:
        if meta.lease_id is None:
            raise InvalidRequestError("LeaseKeeper keeps a lease: pass the meta get_meta() returned, not put()'s")
        if not lease_s > 0:
            raise InvalidRequestError(f"lease_s must be positive (the lease_s given to get_meta), got {lease_s!r}")
        if not 0 < fraction < 1:
            raise InvalidRequestError(f"fraction must be in (0, 1), got {fraction!r}")
        self.store = store
        self.meta = meta
        self.lease_s = float(lease_s)
        self.fraction = float(fraction)
        self._clock = clock
        self._since = clock()  #: when the store last granted or renewed the lease (the keeper's clock)
        self._inflight: asyncio.Future[bool] | None = None
        self.live = True  #: False once the store said the lease is no longer held
        self.supported = True  #: False once the store said it cannot renew
        self.renewals = 0  #: store calls made (each one that found the lease live)
        self.deadline: float | None = meta.deadline  #: the lease's deadline as the store last reported it

    @property
    def due(self) -> bool:
        """Whether a :meth:`renew` now would ask the store."""
        return self.live and self.supported and self._clock() - self._since >= self.fraction * self.lease_s

    async def renew(self) -> bool:
        """Renew when due; returns whether the lease is still held.

        False once the store answered that the lease is gone (acknowledged,
        released, expired, its consumer declared dead, its rows cleared):
        the rows may be leased to someone else, so stop working on them and
        do not acknowledge them. Callers that ask together share one store
        call; a cancelled caller does not cancel it for the others.
        """
        if not self.due:
            return self.live
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._inflight)

    async def _ask(self) -> bool:
        asked = self._clock()
        try:
            deadline = await self.store.renew(self.meta, lease_s=self.lease_s)
        except UnsupportedFeatureError as exc:
            self.supported = False
            log.warning("store %s cannot renew leases (%s); leases last their lease_s", type(self.store).__name__, exc)
            return True
        finally:
            self._inflight = None
        if deadline is None:
            self.live = False
        else:
            self._since, self.deadline = asked, deadline
            self.renewals += 1
        return self.live
