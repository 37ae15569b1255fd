"""A role's actor and its heartbeat, watched from the driver: the errors that say it was lost.

Every :meth:`WatchedActor.call` races the actor's reply against the actor's
death and a deadline (see :mod:`.remote` for what the proxies do with it).
The driver's proxies (:mod:`.remote`) and its weight path (:mod:`.weights`)
both hold watched actors; this module imports neither.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray

from asyncflow_core.errors import EngineError

log = logging.getLogger("asyncflow.ray")


class RoleLost(EngineError):
    """A role's actor died or stopped answering; ``role`` says which (``rollout/0``, ``trainer``, ``reward/1``)."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"{role} actor lost: {reason}")
        self.role = role
        self.reason = reason


class RoleTimeout(RoleLost):
    """A call to a role's actor ran past its deadline; the actor was killed."""


class WatchedActor:
    """One actor plus its heartbeat; ``call`` never outlives the actor or its deadline."""

    def __init__(self, role: str, make: Callable[[], Any], *, heartbeat_s: float, heartbeat_timeout_s: float,
                 on_lost: Callable[[RoleLost], None] | None = None) -> None:
        self.role = role
        self._make = make
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_lost = on_lost
        self.actor: Any = None
        self.lost: RoleLost | None = None
        self._lost_event: asyncio.Event | None = None
        self._beat: asyncio.Task | None = None
        self.spawn()

    def spawn(self) -> None:
        """(Re)create the actor; the heartbeat starts with the first call made on an event loop."""
        self.actor = self._make()
        self.lost = None
        self._lost_event = None
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None

    def _event(self) -> asyncio.Event:
        if self._lost_event is None:
            self._lost_event = asyncio.Event()
            if self.lost is not None:
                self._lost_event.set()
        if self._beat is None and self.lost is None:
            self._beat = asyncio.ensure_future(self._heartbeat())
        return self._lost_event

    def declare_lost(self, err: RoleLost) -> None:
        if self.lost is not None:
            return
        self.lost = err
        if self._lost_event is not None:
            self._lost_event.set()
        log.error("%s", err)
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("%s: kill: %s", self.role, exc)
        if self.on_lost is not None:
            self.on_lost(err)

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``actor.method(*args)``; raises :class:`RoleLost` / :class:`RoleTimeout`, or the backend's own error."""
        lost_event = self._event()
        if self.lost is not None:
            raise self.lost
        ref = getattr(self.actor, method).remote(*args)
        reply = asyncio.ensure_future(_resolve(ref))
        reply.add_done_callback(_retrieve)  # a reply that loses the race to a death still gets its error read
        lost = asyncio.ensure_future(lost_event.wait())
        try:
            done, _ = await asyncio.wait({reply, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if reply in done:
            try:
                return reply.result()
            except ray.exceptions.RayActorError as exc:
                self.declare_lost(RoleLost(self.role, f"its process died ({short_reason(exc)})"))
                raise self.lost from None  # type: ignore[misc]
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                raise cause from None
        reply.cancel()
        if self.lost is None and not done:
            self.declare_lost(RoleTimeout(self.role, f"{method}() did not return within its deadline of {timeout}s"))
        assert self.lost is not None
        raise self.lost

    async def _heartbeat(self) -> None:
        try:
            while self.lost is None:
                await asyncio.sleep(self.heartbeat_s)
                if self.lost is not None:
                    return
                try:
                    await asyncio.wait_for(_resolve(self.actor.health.remote()), self.heartbeat_timeout_s)
                except TimeoutError:
                    self.declare_lost(RoleLost(self.role, f"no heartbeat answer within {self.heartbeat_timeout_s}s"))
                except ray.exceptions.RayActorError as exc:
                    self.declare_lost(RoleLost(self.role, f"its process died ({short_reason(exc)})"))
                except Exception as exc:  # noqa: BLE001 - the backend's health() raised: it is alive, the stage decides
                    log.debug("%s: health() raised %s", self.role, exc)
        except asyncio.CancelledError:
            pass

    def kill(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("%s: kill: %s", self.role, exc)


async def _resolve(ref: Any) -> Any:
    return await ref


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def short_reason(exc: BaseException) -> str:
    """The first line of an error's message (at most 200 characters), or its type's name."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


__all__ = ["RoleLost", "RoleTimeout", "WatchedActor", "short_reason"]
