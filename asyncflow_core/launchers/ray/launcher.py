"""The ``ray`` launcher: start or join Ray, reserve resources, build each role as an actor, run the flow runtime.

The flow runtime runs in the driver (this process) exactly as under the
``local`` launcher; :class:`RayRoles` is the one thing that differs: it builds
rollout replicas, the trainer (and a reference model) and the reward as
actors behind proxies, and the store on its ray deployment. It places and
builds each role from its record (:class:`~asyncflow_core.flow.roles.RoleSpec`):
by the record's ``interface``, never by its name, so a new role with a known
interface needs no change here.

A reward whose replicas are a role of their own (a ``model`` reward: its
``reward_model`` role) is built in the driver, thin, and its replicas are
actors in their own placement group, with the CPUs and GPUs its
``placement`` asks for: built once for the run, not once per reward worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncflow_core.config.loader import ResolvedConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.checkpoint import latest_checkpoint
from asyncflow_core.flow.roles import RoleSpec, Roles, WeightPolicy
from asyncflow_core.flow.runtime import FlowRuntime
from asyncflow_core.flow.stage import RunStopped
from asyncflow_core.interfaces import Launcher
from asyncflow_core.launchers.ray.actors import RewardActor, RewardModelActor, RolloutActor, TrainActor
from asyncflow_core.launchers.ray.config import RayLauncherConfig
from asyncflow_core.launchers.ray.remote import (
    RemoteRewardModel,
    RemoteRewardPool,
    RemoteRolloutEngine,
    RemoteTrainEngine,
)
from asyncflow_core.launchers.ray.watch import RoleLost, WatchedActor
from asyncflow_core.launchers.ray.weights import RayWeights

log = logging.getLogger("asyncflow.ray")

_RemoteRollout = ray.remote(RolloutActor)
_RemoteTrain = ray.remote(TrainActor)
_RemoteReward = ray.remote(RewardActor)
_RemoteRewardModel = ray.remote(RewardModelActor)

def start_ray(options: RayLauncherConfig, min_cpus: float = 1) -> bool:
    """Join ``options.address`` or start a loopback-only single-host Ray; True when this call started it.

    A Ray started here gets ``options.num_cpus`` logical CPUs, by default this
    machine's count or what the run's reservations add up to, whichever is
    more (the ``local`` launcher shares the cores among the roles the same way).
    """
    if ray.is_initialized():
        return False
    if options.address:
        kwargs = {}
        if options.address.split(":")[0] in ("127.0.0.1", "localhost"):
            # a loopback-only Ray on this host (init_local_ray): this driver must bind to loopback as well, or Ray
            # picks the host's routable address, finds no raylet there, and would listen on all interfaces
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
            kwargs["_node_ip_address"] = "127.0.0.1"
        try:
            ray.init(address=options.address, namespace=options.namespace, log_to_driver=False,
                     logging_level="ERROR", **kwargs)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"launcher.options.address={options.address!r}: cannot join that Ray cluster "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); start it with "
                              "`ray start --head` or leave address unset to start one here") from None
        return True
    from asyncflow_core.store.deployments.ray_store import init_local_ray

    kwargs: dict[str, Any] = {}
    if options.num_gpus is not None:
        kwargs["num_gpus"] = options.num_gpus
    if options.namespace:
        kwargs["namespace"] = options.namespace
    num_cpus = options.num_cpus or max(os.cpu_count() or 1, math.ceil(min_cpus))
    init_local_ray(num_cpus=num_cpus, **kwargs)
    return True


class RayRoles(Roles):
    """Builds every role of a run as Ray actors (placement per ``launcher.options``) and watches them."""

    def __init__(self, options: RayLauncherConfig, resolved: ResolvedConfig) -> None:
        super().__init__()
        self.options = options
        self.resolved = resolved
        cfg = resolved.config
        self.namespace = options.namespace or f"asyncflow-{cfg.name}-{uuid.uuid4().hex[:8]}"
        self.deadline_s = cfg.weight_transport.deadline_s
        self.bucket_cache: dict[Any, Any] = {}
        mode = options.weights
        if mode != "driver" and cfg.weight_transport.name != "inprocess":
            raise ConfigError(
                f"weight_transport.name={cfg.weight_transport.name!r} is used only with launcher.options.weights="
                f"driver; with weights={mode} the ray launcher moves weights between its actors itself: set "
                "weight_transport.name=inprocess (its bucket_mb and deadline_s still apply) or weights=driver"
            )
        #: how weights go from the trainer actor to the rollout actors (launcher.options.weights)
        self.weights = RayWeights(mode, deadline_s=self.deadline_s, counters=self.counters,
                                  backend="nccl" if options.trainer_gpus and options.rollout_gpus else "gloo")
        self.groups: dict[str, Any] = {}
        self.bundle_of: dict[tuple[str, int], tuple[Any, int]] = {}
        self.watched: list[WatchedActor] = []
        self.proxies: list[Any] = []
        self._fatal: RoleLost | None = None
        self._fatal_event = asyncio.Event()
        #: (role, index) -> (pool, first bundle in the pool) of each instance (from the declared roles)
        self.slot_of: dict[tuple[str, int], tuple[str, int]] = {}
        self._builders = {"rollout": self._build_rollout, "train": self._build_train, "reward": self._build_reward,
                          "reward_model": self._build_reward_model}

    @property
    def needs_ref(self) -> bool:
        """Whether the run declared a reference-model role."""
        return "ref" in self.specs

    # -- placement ---------------------------------------------------------------------

    def _rank_actors(self) -> int:
        from asyncflow_core.launchers.ray.ranks import trainer_rank_actors

        return trainer_rank_actors(self.options.trainer_ranks, self.resolved.components["trainer"].options)

    def _resources(self, spec: RoleSpec) -> tuple[float, float]:
        """CPUs and GPUs of one instance's actor: its ``placement`` when it has one, else ``<resources>_cpus`` /
        ``<resources>_gpus`` from the launcher options."""
        if spec.placement is not None:
            return spec.placement.cpus, spec.placement.gpus
        o = self.options
        return getattr(o, f"{spec.resources}_cpus", 1.0), getattr(o, f"{spec.resources}_gpus", 0) or 0

    def _instance_bundles(self, spec: RoleSpec) -> list[dict[str, float]]:
        """The bundles one instance of ``spec`` reserves: its actor's, then (train) one per rank actor or
        (reward) one per worker; none for a reward whose replicas are a role of their own (it runs here)."""
        o = self.options
        own = self._bundle(*self._resources(spec))
        if spec.interface == "train":
            return [own] + [self._bundle(o.trainer_rank_cpus, o.trainer_rank_gpus)] * self._rank_actors()
        if spec.interface == "reward":
            return [] if self.served_by(spec.name) else [own] * o.reward_workers
        return [own]

    def _pools(self) -> dict[str, list[dict[str, float]]]:
        """Bundles per resource pool, every declared role's instances in order (build() finds them by slot_of)."""
        if not self.specs:
            raise RuntimeError("RayRoles: declare the run's roles first (FlowRuntime.role_specs())")
        pools: dict[str, list[dict[str, float]]] = {}
        for spec in self.specs.values():
            pool = pools.setdefault(spec.resources, [])
            for i in range(spec.count):
                self.slot_of[(spec.name, i)] = (spec.resources, len(pool))
                pool.extend(self._instance_bundles(spec))
        return pools

    def cpus_needed(self) -> float:
        """CPUs every role's reservation adds up to."""
        return sum(b.get("CPU", 0) for bs in self._pools().values() for b in bs)

    def place(self) -> None:
        """Reserve the bundles of every role pool (placement groups) and wait until they are ready."""
        o = self.options
        if o.placement == "none":
            return
        pools = {pool: bs for pool, bs in self._pools().items() if bs}  # a reward served by its model's role: none
        if o.placement == "colocated":
            bundles, where = [], {}
            for pool, bs in pools.items():
                for i, b in enumerate(bs):
                    where[(pool, i)] = len(bundles)
                    bundles.append(b)
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{self.namespace}-all")
            self.groups["all"] = pg
            self.bundle_of = {key: (pg, idx) for key, idx in where.items()}
        else:
            for pool, bs in pools.items():
                pg = placement_group(bs, strategy="PACK", name=f"{self.namespace}-{pool}")
                self.groups[pool] = pg
                for i in range(len(bs)):
                    self.bundle_of[(pool, i)] = (pg, i)
        need_cpu = sum(b.get("CPU", 0) for bs in pools.values() for b in bs)
        need_gpu = sum(b.get("GPU", 0) for bs in pools.values() for b in bs)
        ready = [pg.ready() for pg in self.groups.values()]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=o.start_timeout_s)
        if len(done) < len(ready):
            have = ray.cluster_resources()
            self.remove_groups()
            raise ConfigError(
                f"the ray launcher's placement ({o.placement}) needs {need_cpu:g} CPUs and {need_gpu:g} GPUs "
                f"({self._describe_needs()}), the cluster has {have.get('CPU', 0):g} CPUs and "
                f"{have.get('GPU', 0):g} GPUs; lower launcher.options.*_cpus / *_gpus (a reward model's: "
                "reward.options.placement), raise num_cpus, or add nodes"
            )

    def _describe_needs(self) -> str:
        """What each role reserves, e.g. ``rollout 2 x 0.5 CPU, reward_model 1 x 1 CPU + 1 GPU`` (per instance)."""
        parts = []
        for spec in self.specs.values():
            bs = self._instance_bundles(spec)
            if not bs:
                continue
            if len(bs) > 1:  # a trainer with rank actors: its own bundle, then one per rank actor
                own, rank = bs[0], bs[1]
                what = (f"{own.get('CPU', 0):g} + {len(bs) - 1} rank actors x {rank.get('CPU', 0):g} CPU"
                        + (f" + {rank.get('GPU', 0):g} GPU" if rank.get("GPU") else ""))
                parts.append(f"{spec.name} {what}" if spec.count == 1 else f"{spec.name} {spec.count} x ({what})")
                continue
            cpu, gpu = sum(b.get("CPU", 0) for b in bs), sum(b.get("GPU", 0) for b in bs)
            parts.append(f"{spec.name} {spec.count} x {cpu:g} CPU" + (f" + {gpu:g} GPU" if gpu else ""))
        return ", ".join(parts)

    @staticmethod
    def _bundle(cpus: float, gpus: float) -> dict[str, float]:
        b = {"CPU": cpus}
        if gpus:
            b["GPU"] = gpus
        return {k: v for k, v in b.items() if v} or {"CPU": 0.001}  # a bundle must reserve something

    def remove_groups(self) -> None:
        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001 - the cluster is going away anyway
                log.debug("remove placement group: %s", exc)
        self.groups.clear()

    def _actor_options(self, pool: str, index: int, cpus: float, gpus: float) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0, "namespace": self.namespace}
        if (pool, index) in self.bundle_of:
            pg, idx = self.bundle_of[(pool, index)]
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=idx)
        return opts

    def _watched(self, role: str, remote_cls: Any, opts: dict[str, Any], factory: Any, options: Any,
                 fatal: bool, **init: Any) -> WatchedActor:
        spawned = Counter()

        def make() -> Any:
            spawned[role] += 1
            # a fresh name per incarnation: a killed actor's name stays taken for a moment
            suffix = "" if spawned[role] == 1 else f".r{spawned[role] - 1}"
            return remote_cls.options(name=f"{role.replace('/', '-')}{suffix}", **opts).remote(factory, options, **init)

        w = WatchedActor(role, make, heartbeat_s=self.options.heartbeat_s,
                         heartbeat_timeout_s=self.options.heartbeat_timeout_s,
                         on_lost=self._on_fatal if fatal else None)
        self.watched.append(w)
        return w

    def _on_fatal(self, err: RoleLost) -> None:
        if self._fatal is None:
            self._fatal = err
            self._fatal_event.set()

    # -- the Roles interface --------------------------------------------------------------

    def build(self, section: str, factory: Any, options: Any, *, role: str, index: int = 0) -> Any:
        spec = self.specs.get(role)
        if spec is None:  # not a role: a component built in the driver, unless this launcher provides its own
            return self._component(section, factory, options)
        builder = self._builders.get(spec.interface)
        if builder is None:
            raise ConfigError(f"the ray launcher cannot place role {spec.name!r}: it knows the interfaces "
                              f"{sorted(self._builders)}, not {spec.interface!r}")
        proxy = builder(spec, factory, options, index)
        self.proxies.append(proxy)
        return proxy

    def _placed(self, spec: RoleSpec, index: int, offset: int = 0) -> tuple[str, int]:
        if (spec.name, index) not in self.slot_of:
            self._pools()
        pool, first = self.slot_of[(spec.name, index)]
        return pool, first + offset

    def _build_rollout(self, spec: RoleSpec, factory: Any, options: Any, index: int) -> Any:
        """A rollout engine actor: a replica that follows the policy's versions, or (a judge) one that keeps its
        own weights and never joins the weight path."""
        o = self.options
        pool, slot = self._placed(spec, index)
        w = self._watched(f"{spec.name}/{index}", _RemoteRollout,
                          self._actor_options(pool, slot, *self._resources(spec)), factory, options, fatal=spec.fatal)
        follows = spec.weights is WeightPolicy.FOLLOWS
        proxy = RemoteRolloutEngine(w, deadline_s=self.deadline_s, max_restarts=o.max_restarts,
                                    bucket_cache=self.bucket_cache, counters=self.counters,
                                    weights=self.weights if follows else None,
                                    restart_counter=_restart_counter(spec))
        if follows:
            self.weights.add_replica(proxy)
        return proxy

    def _build_train(self, spec: RoleSpec, factory: Any, options: Any, index: int) -> Any:
        from asyncflow_core.launchers.ray.ranks import RayRankSpawner, trainer_rank_actors

        o = self.options
        ranks = trainer_rank_actors(o.trainer_ranks, options)
        pool, slot = self._placed(spec, index)
        init: dict[str, Any] = {}
        if ranks:
            placed = [self.bundle_of[(pool, slot + 1 + r)] for r in range(ranks) if (pool, slot + 1 + r) in self.bundle_of]
            spawner = RayRankSpawner(num_cpus=o.trainer_rank_cpus, num_gpus=o.trainer_rank_gpus,
                                     placement_group=placed[0][0] if placed else None,
                                     bundle_indices=tuple(i for _, i in placed), start_timeout_s=o.start_timeout_s)
            init["rank_spawner"] = spawner  # the trainer actor installs it before it builds the engine
        name = spec.name if spec.count == 1 else f"{spec.name}/{index}"
        w = self._watched(name, _RemoteTrain,
                          self._actor_options(pool, slot, getattr(o, f"{spec.resources}_cpus"),
                                              getattr(o, f"{spec.resources}_gpus", 0)),
                          factory, options, fatal=spec.fatal, **init)
        # only the publishing trainer sends weights over the launcher's weight path
        publishes = spec.weights is WeightPolicy.PUBLISHES
        return RemoteTrainEngine(w, deadline_s=self.deadline_s, weights=self.weights if publishes else None)

    def _build_reward(self, spec: RoleSpec, factory: Any, options: Any, index: int) -> Any:
        if self.served_by(spec.name):
            # its model runs on its own role's actors (built once, below, and handed to it): the reward itself is
            # thin dispatch, built here in the driver, and no reward worker loads a copy of the model
            return self.serve(spec.name, factory(options))
        o = self.options
        pool, slot = self._placed(spec, index)
        workers = [self._watched(f"{spec.name}/{i}", _RemoteReward,
                                 self._actor_options(pool, slot + i, getattr(o, f"{spec.resources}_cpus"), 0),
                                 factory, options, fatal=spec.fatal)
                   for i in range(o.reward_workers)]
        return RemoteRewardPool(workers, max_restarts=o.max_restarts, counters=self.counters)

    def build_instance(self, spec: RoleSpec, index: int) -> Any:
        """Instance ``index`` of a served role (a reward model's replica) as an actor behind its proxy, by the
        record's ``interface``; with ``placement.gpus`` it runs on its own GPU (``device: cuda``)."""
        builder = self._builders.get(spec.interface)
        if builder is None:
            raise ConfigError(f"the ray launcher cannot place role {spec.name!r}: it knows the interfaces "
                              f"{sorted(self._builders)}, not {spec.interface!r}")
        options = spec.options
        _, gpus = self._resources(spec)
        device = getattr(options, "device", None)
        if "device" in getattr(type(options), "model_fields", {}) and (gpus or device == "auto"):
            # with num_gpus Ray sets the actor's CUDA_VISIBLE_DEVICES (its GPU is cuda:0); without, the actor still
            # sees the host's GPUs (Ray 2.60 leaves the variable alone), so "auto" must not pick an unreserved one
            device = "cuda" if gpus else "cpu"
            options = options.model_copy(update={"device": device})
        if not gpus and isinstance(device, str) and device.startswith("cuda"):
            raise ConfigError(f"role {spec.name!r} asks for device {device} but reserves no GPU under the ray "
                              "launcher; set its placement gpus (reward.options.placement.gpus: 1) or its device "
                              "to cpu")
        proxy = builder(spec, spec.factory, options, index)
        self.proxies.append(proxy)
        return proxy

    def _build_reward_model(self, spec: RoleSpec, factory: Any, options: Any, index: int) -> Any:
        o = self.options
        pool, slot = self._placed(spec, index)
        w = self._watched(f"{spec.name}/{index}", _RemoteRewardModel,
                          self._actor_options(pool, slot, *self._resources(spec)), factory, options, fatal=spec.fatal)
        return RemoteRewardModel(w, max_restarts=o.max_restarts, counters=self.counters,
                                 start_timeout_s=o.start_timeout_s)

    def _component(self, section: str, factory: Any, options: Any) -> Any:
        """A component that is not a role: the ray weight path's transport and the ray store replace the
        configured ones when the launcher options ask for them; anything else is built here."""
        if section == "weight_transport" and self.weights.mode != "driver":
            return self.weights.make_transport()  # handles pass through it; the bytes go actor to actor
        if section == "store" and self.options.store == "ray" and self.resolved.config.store.name == "inprocess":
            from asyncflow_core.plugins import get_plugin_manager
            from asyncflow_core.store.options import StoreOptions

            shared = options.model_dump(include=set(StoreOptions.model_fields))
            return get_plugin_manager().create("store", "ray", shared)
        return factory(options)

    async def lost(self) -> None:
        await self._fatal_event.wait()
        assert self._fatal is not None
        raise self._fatal

    async def close(self) -> None:
        for w in self.watched:
            w.kill()
        self.remove_groups()


class RayLauncher(Launcher):
    """Runs a config with every role as a Ray actor; the flow runtime itself runs in this (the driver) process."""

    def __init__(self, config: RayLauncherConfig | None = None) -> None:
        self.options = config or RayLauncherConfig()
        self.roles: RayRoles | None = None
        self.runtime: FlowRuntime | None = None
        self._started_ray = False

    async def run(self, config: Any, *, run_dir: Path | None = None, progress: bool = False,
                  resume: bool = False) -> dict[str, Any]:
        from asyncflow_core.config.loader import resolve

        resolved = config if isinstance(config, ResolvedConfig) else resolve(config)
        t0 = time.perf_counter()
        self.roles = RayRoles(self.options, resolved)
        self.runtime = FlowRuntime(resolved, run_dir=run_dir, progress=progress, resume=resume, roles=self.roles)
        self.roles.declare(self.runtime.role_specs())  # the algorithm is built once, by the runtime
        self._started_ray = start_ray(self.options, self.roles.cpus_needed()) or self._started_ray
        try:
            self.roles.place()
            try:
                summary = await self.runtime.run()
            except RoleLost as exc:
                if self.roles.fatal(exc.role):
                    raise RunStopped(_trainer_lost_message(exc, run_dir)) from None
                raise
            summary["launcher"] = {"name": "ray", "namespace": self.roles.namespace,
                                   "start_seconds": round(time.perf_counter() - t0 - summary["wall_seconds"], 3)}
            return summary
        finally:
            await self.roles.close()

    async def shutdown(self) -> None:
        """Kill the run's actors and, when this launcher started Ray, stop it."""
        if self.roles is not None:
            await self.roles.close()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False


def _restart_counter(spec: RoleSpec) -> str:
    """The counter a replaced actor of ``spec`` adds to: ``rollout_actor_restarts``, or ``reward_model_restarts``
    for a served role's (a judge's) engines."""
    return f"{spec.serves}_model_restarts" if spec.serves else f"{spec.resources}_actor_restarts"


def _trainer_lost_message(exc: RoleLost, run_dir: Path | None) -> str:
    if run_dir is None:
        return (f"the {exc.role} died ({exc.reason}); the run stopped. It had no run directory, so nothing can be "
                "resumed")
    try:
        found = latest_checkpoint(run_dir)
    except ConfigError:
        found = None
    if found is None:
        return (f"the {exc.role} died ({exc.reason}); the run stopped before its first checkpoint, so start it again "
                "(set trainer.checkpoint_every to make runs resumable)")
    return (f"the {exc.role} died ({exc.reason}); the run stopped at its last checkpoint (step {found[1].version}): "
            f"continue it with `asyncflow run --resume {run_dir}`")
