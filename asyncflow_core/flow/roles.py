"""Roles as records: what a run needs built where, and how a launcher builds it.

The runtime emits one :class:`RoleSpec` per role (:func:`run_roles`); a
launcher's :class:`Roles` places and builds each from its record alone, so
adding a role (a reward-model pool, eval replicas) is one record here and no
launcher change, as long as its ``interface`` is one the launchers know.
Components that are not roles (store, data, algorithm, weight transport) are
built in the runtime's process by their plugin's factory unless a launcher
overrides one in :meth:`Roles.build`.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["RoleSpec", "Roles", "WeightPolicy", "run_roles"]


class WeightPolicy(str, enum.Enum):
    """How a role's weights change over a run."""

    PUBLISHES = "publishes"  #: trains and publishes new versions (the trainer)
    FOLLOWS = "follows"  #: loads every published version (rollout replicas)
    FROZEN = "frozen"  #: keeps the weights it started with (the reference model, judges)
    NONE = "none"  #: has no weights the run manages (a rule-based reward)


@dataclass(frozen=True)
class RoleSpec:
    """One role of a run.

    ``name`` is the role (and the prefix of its instances' names,
    ``<name>/<index>``); ``section`` the config section whose plugin builds
    it; ``interface`` the contract its instances implement (``rollout``,
    ``train`` or ``reward``), which is what a launcher places by;
    ``count`` how many instances the runtime builds; ``fatal`` whether
    losing it ends the run (else the launcher replaces it); ``weights`` its
    :class:`WeightPolicy`; ``resources`` the pool a launcher reserves its
    resources in (the ray launcher reads ``<resources>_cpus`` /
    ``<resources>_gpus`` from its options).
    """

    name: str
    section: str
    interface: str
    count: int = 1
    fatal: bool = False
    weights: WeightPolicy = WeightPolicy.NONE
    resources: str = ""

    def __post_init__(self) -> None:
        if not self.resources:
            object.__setattr__(self, "resources", self.section)


def run_roles(cfg: Any, *, needs_ref: bool) -> tuple[RoleSpec, ...]:
    """The roles of a run of ``cfg``: rollout replicas, the trainer, the reference model when needed, the reward."""
    roles = [
        RoleSpec("rollout", "rollout", "rollout", count=cfg.rollout.replicas, weights=WeightPolicy.FOLLOWS),
        RoleSpec("trainer", "trainer", "train", fatal=True, weights=WeightPolicy.PUBLISHES),
    ]
    if needs_ref:
        roles.append(RoleSpec("ref", "trainer", "train", fatal=True, weights=WeightPolicy.FROZEN))
    roles.append(RoleSpec("reward", "reward", "reward"))
    return tuple(roles)


class Roles:
    """Where a run's components are built, and how the loss of one is reported.

    The ``local`` launcher uses this class itself: every component is built
    here, in this process, by its plugin's factory, and nothing can be lost
    out from under the run. Other launchers subclass it (the ``ray``
    launcher builds each role as actors behind proxies with the same
    interfaces), so the runtime and the stages stay the same under every
    launcher. The runtime :meth:`declare` s the run's roles before it builds
    any of them.
    """

    def __init__(self) -> None:
        #: the run's counters (the runtime uses this very Counter): launcher events land in metrics and summary
        self.counters: Counter[str] = Counter()
        self.specs: dict[str, RoleSpec] = {}  #: the run's roles by name (see :meth:`declare`)

    def declare(self, specs: Iterable[RoleSpec]) -> None:
        """The run's roles (:func:`run_roles`); placement-aware launchers reserve resources from these."""
        self.specs = {s.name: s for s in specs}

    def fatal(self, role: str) -> bool:
        """Whether losing an instance of ``role`` (``name`` or ``name/index``) ends the run."""
        spec = self.specs.get(role.split("/")[0])
        return spec is not None and spec.fatal

    def build(self, section: str, factory: Any, options: Any, *, role: str, index: int = 0) -> Any:
        """The component of config section ``section`` (``role``: a declared role's name; ``index``: the instance)."""
        return factory(options)

    async def lost(self) -> None:
        """Raises when a role the run cannot go on without is gone; local roles never are."""
        await asyncio.Event().wait()
