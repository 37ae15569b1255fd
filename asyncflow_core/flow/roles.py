"""Roles as records: what a run needs built where, and how a launcher builds it.

The runtime emits one :class:`RoleSpec` per role (:func:`run_roles`); a
launcher's :class:`Roles` places and builds each from its record alone, so
adding a role (a reward-model pool, eval replicas) is one record here and no
launcher change, as long as its ``interface`` is one the launchers know.
Components that are not roles (store, data, algorithm, weight transport) are
built in the runtime's process by their plugin's factory unless a launcher
overrides one in :meth:`Roles.build`.

A plugin may need replicas of its own: a ``model`` reward serves its reward
model or judge on replicas that get their own devices. Its options declare
them (a ``served_roles()`` method returning :class:`RoleSpec` records with
``serves`` set to the role that uses them, a ``factory`` and ``options`` that
build one instance, and a :class:`Placement`); :func:`run_roles` emits them
beside the run's own roles, and :meth:`Roles.build` builds them where the
launcher places them and hands them to the component (its ``serve(name,
instances)``) right after building it.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncflow_core.errors import ConfigError

__all__ = ["Placement", "RoleSpec", "Roles", "WeightPolicy", "run_roles"]


class WeightPolicy(str, enum.Enum):
    """How a role's weights change over a run."""

    PUBLISHES = "publishes"  #: trains and publishes new versions (the trainer)
    FOLLOWS = "follows"  #: loads every published version (rollout replicas)
    FROZEN = "frozen"  #: keeps the weights it started with (the reference model, judges)
    NONE = "none"  #: has no weights the run manages (a rule-based reward)


@dataclass(frozen=True)
class Placement:
    """Where a role's instances go, as its own config asks (a role without one is placed by launcher options).

    ``devices`` is for launchers that run instances in their own process
    (``local``): instance ``i`` gets ``devices[i]`` (``cuda:1``, ``cpu``); empty,
    each keeps the device its options name. ``cpus`` / ``gpus`` are what a
    launcher that starts a process per instance (``ray``) reserves for each;
    Ray then sets the instance's ``CUDA_VISIBLE_DEVICES``, so it sees its GPU
    as ``cuda:0``.
    """

    cpus: float = 1.0
    gpus: float = 0.0
    devices: tuple[str, ...] = ()

    def device(self, index: int) -> str | None:
        """The device of instance ``index`` under an in-process launcher, or None (its options decide)."""
        return self.devices[index] if self.devices else None


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
    ``<resources>_gpus`` from its options unless ``placement`` says).

    A served role (``serves`` names the role whose component uses its
    instances, e.g. ``reward``) is built from the record alone: ``factory``
    (picklable, module level) builds one instance from ``options`` (a
    pydantic model; a ``device`` field, when it has one, is set per instance
    from ``placement.devices``), and ``placement`` says what each instance
    gets.
    """

    name: str
    section: str
    interface: str
    count: int = 1
    fatal: bool = False
    weights: WeightPolicy = WeightPolicy.NONE
    resources: str = ""
    placement: Placement | None = None
    serves: str = ""
    factory: Any = None
    options: Any = None

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
    roles.extend(served_roles(cfg.reward, serves="reward"))
    names = [r.name for r in roles]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"two roles are named {name!r}; give each reward term its own label")
    return tuple(roles)


def served_roles(section: Any, *, serves: str) -> tuple[RoleSpec, ...]:
    """The roles the plugin of config ``section`` (a :class:`Component`) declares for its own replicas.

    Its validated options declare them with a ``served_roles(serves=...)``
    method (``reward.options`` of ``model`` and ``combined``); options without
    one declare none.
    """
    from asyncflow_core.plugins import PluginKind, get_plugin_manager

    options = get_plugin_manager().validate_options(PluginKind(serves), section.name, section.options,
                                                    where=f"{serves}.options")
    declare = getattr(options, "served_roles", None)
    return tuple(declare(serves=serves)) if callable(declare) else ()


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
        """The component of config section ``section`` (``role``: a declared role's name; ``index``: the instance),
        handed the instances of the roles that serve it (:meth:`serve`)."""
        return self.serve(role, factory(options))

    def served_by(self, role: str) -> list[RoleSpec]:
        """The declared roles whose instances ``role``'s component uses."""
        return [s for s in self.specs.values() if s.serves == role]

    def serve(self, role: str, component: Any) -> Any:
        """Build every instance of the roles that serve ``role`` and hand them to ``component``'s
        ``serve(name, instances)``; returns ``component``."""
        for spec in self.served_by(role):
            instances = [self.build_instance(spec, i) for i in range(spec.count)]
            component.serve(spec.name, instances)
        return component

    def build_instance(self, spec: RoleSpec, index: int) -> Any:
        """Instance ``index`` of served role ``spec``: here, in this process, on ``placement.devices[index]``."""
        return spec.factory(instance_options(spec, index))

    async def lost(self) -> None:
        """Raises when a role the run cannot go on without is gone; local roles never are."""
        await asyncio.Event().wait()


def instance_options(spec: RoleSpec, index: int) -> Any:
    """``spec.options`` of instance ``index`` in this process: its ``device`` field set from ``placement.devices``."""
    options = spec.options
    device = spec.placement.device(index) if spec.placement is not None else None
    if device is not None and "device" in getattr(type(options), "model_fields", {}):
        options = options.model_copy(update={"device": device})
    return options
