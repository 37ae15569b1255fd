"""The ``ray`` launcher: start or join Ray, reserve resources, build each role as an actor, run the flow runtime.

The flow runtime runs in the driver (this process) exactly as under the
``local`` launcher; :class:`RayRoles` is the one thing that differs: it builds
rollout replicas, the trainer (and a reference model) and the reward as
actors behind proxies, and the store on its ray deployment.
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
from asyncflow_core.flow.runtime import FlowRuntime, Roles
from asyncflow_core.flow.stage import RunStopped
from asyncflow_core.interfaces import Launcher
from asyncflow_core.launchers.ray.actors import RewardActor, RolloutActor, TrainActor
from asyncflow_core.launchers.ray.config import RayLauncherConfig
from asyncflow_core.launchers.ray.remote import RemoteRewardPool, RemoteRolloutEngine, RemoteTrainEngine
from asyncflow_core.launchers.ray.watch import RoleLost, WatchedActor
from asyncflow_core.launchers.ray.weights import RayWeights

log = logging.getLogger("asyncflow.ray")

_RemoteRollout = ray.remote(RolloutActor)
_RemoteTrain = ray.remote(TrainActor)
_RemoteReward = ray.remote(RewardActor)

#: roles whose loss ends the run (rollout replicas and reward workers are replaced instead)
FATAL_ROLES = ("trainer", "ref")


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
        algorithm = resolved.components["algorithm"]
        algo = algorithm.registered.record.factory(algorithm.options)
        self.needs_ref = "ref_logprobs" in getattr(algo, "required_columns", ())

    # -- placement ---------------------------------------------------------------------

    def _pools(self) -> dict[str, list[dict[str, float]]]:
        from asyncflow_core.launchers.ray.ranks import trainer_rank_actors

        o, cfg = self.options, self.resolved.config
        # one slot per trainer (the policy's, then the reference model's): the trainer actor's bundle, then one
        # bundle per rank actor when its ranks are actors (build() finds them at the same indices)
        ranks = trainer_rank_actors(o.trainer_ranks, self.resolved.components["trainer"].options)
        slot = [self._bundle(o.trainer_cpus, o.trainer_gpus)]
        slot += [self._bundle(o.trainer_rank_cpus, o.trainer_rank_gpus)] * ranks
        return {
            "rollout": [self._bundle(o.rollout_cpus, o.rollout_gpus)] * cfg.rollout.replicas,
            "trainer": slot * (2 if self.needs_ref else 1),
            "reward": [self._bundle(o.reward_cpus, 0)] * o.reward_workers,
        }

    def cpus_needed(self) -> float:
        """CPUs every role's reservation adds up to."""
        return sum(b.get("CPU", 0) for bs in self._pools().values() for b in bs)

    def place(self) -> None:
        """Reserve the bundles of every role pool (placement groups) and wait until they are ready."""
        o, cfg = self.options, self.resolved.config
        if o.placement == "none":
            return
        pools = self._pools()
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
            trainers = len(pools["trainer"]) // (2 if self.needs_ref else 1)
            ranks = f" + {trainers - 1} rank actors x {o.trainer_rank_cpus:g}" if trainers > 1 else ""
            raise ConfigError(
                f"the ray launcher's placement ({o.placement}) needs {need_cpu:g} CPUs and {need_gpu:g} GPUs "
                f"(rollout {cfg.rollout.replicas} x {o.rollout_cpus:g}, trainer {o.trainer_cpus:g}{ranks}, reward "
                f"{o.reward_workers} x {o.reward_cpus:g}), the cluster has {have.get('CPU', 0):g} CPUs and "
                f"{have.get('GPU', 0):g} GPUs; lower launcher.options.*_cpus / *_gpus, raise num_cpus, or add nodes"
            )

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
        o = self.options
        if section == "rollout":
            w = self._watched(f"rollout/{index}", _RemoteRollout,
                              self._actor_options("rollout", index, o.rollout_cpus, o.rollout_gpus),
                              factory, options, fatal=False)
            proxy = RemoteRolloutEngine(w, deadline_s=self.deadline_s, max_restarts=o.max_restarts,
                                        bucket_cache=self.bucket_cache, counters=self.counters, weights=self.weights)
            self.weights.add_replica(proxy)
        elif section == "trainer":
            from asyncflow_core.launchers.ray.ranks import RayRankSpawner, trainer_rank_actors

            ranks = trainer_rank_actors(o.trainer_ranks, options)
            idx = (1 if role == "ref" else 0) * (1 + ranks)  # this trainer's slot in the trainer pool (see _pools)
            init: dict[str, Any] = {}
            if ranks:
                placed = [self.bundle_of[("trainer", idx + 1 + r)] for r in range(ranks)
                          if ("trainer", idx + 1 + r) in self.bundle_of]
                spawner = RayRankSpawner(num_cpus=o.trainer_rank_cpus, num_gpus=o.trainer_rank_gpus,
                                         placement_group=placed[0][0] if placed else None,
                                         bundle_indices=tuple(i for _, i in placed), start_timeout_s=o.start_timeout_s)
                init["rank_spawner"] = spawner  # the trainer actor installs it before it builds the engine
            w = self._watched(role, _RemoteTrain, self._actor_options("trainer", idx, o.trainer_cpus, o.trainer_gpus),
                              factory, options, fatal=True, **init)
            proxy = RemoteTrainEngine(w, deadline_s=self.deadline_s,
                                      weights=self.weights if role == "trainer" else None)
        elif section == "reward":
            workers = [self._watched(f"reward/{i}", _RemoteReward,
                                     self._actor_options("reward", i, o.reward_cpus, 0), factory, options, fatal=False)
                       for i in range(o.reward_workers)]
            proxy = RemoteRewardPool(workers, max_restarts=o.max_restarts, counters=self.counters)
        elif section == "weight_transport" and self.weights.mode != "driver":
            return self.weights.make_transport()  # handles pass through it; the bytes go actor to actor
        elif section == "store" and o.store == "ray" and self.resolved.config.store.name == "inprocess":
            from asyncflow_core.plugins import get_plugin_manager
            from asyncflow_core.store.options import StoreOptions

            shared = options.model_dump(include=set(StoreOptions.model_fields))
            return get_plugin_manager().create("store", "ray", shared)
        else:
            return factory(options)
        self.proxies.append(proxy)
        return proxy

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
        self._started_ray = start_ray(self.options, self.roles.cpus_needed()) or self._started_ray
        try:
            self.roles.place()
            self.runtime = FlowRuntime(resolved, run_dir=run_dir, progress=progress, resume=resume, roles=self.roles)
            try:
                summary = await self.runtime.run()
            except RoleLost as exc:
                if exc.role in FATAL_ROLES:
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
