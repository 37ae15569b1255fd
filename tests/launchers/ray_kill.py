"""Killing a Ray actor in a drill, and waiting until the kill has landed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray


async def kill_and_wait(actor: Any, what: str, *, within_s: float = 10.0) -> None:
    """``ray.kill`` the actor and return once it stops answering.

    ``ray.kill`` goes through the GCS while a call goes straight to the
    actor, so a call made at once may still be served: a drill that needs
    the next call to meet the death waits for it to show first.
    """
    ray.kill(actor, no_restart=True)
    for _ in range(int(within_s / 0.05)):
        try:
            await actor.health.remote()
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"the killed {what} still answered {within_s:g} s after ray.kill")
