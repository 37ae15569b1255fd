"""The flow runtime: builds a run's engines, store and stages from a resolved config and runs them.

``await FlowRuntime(resolved).run()`` runs on whatever event loop it is
awaited on. :func:`run_flow` picks the loop: a real one, or the virtual-clock
loop (:mod:`asyncflow_core.flow.clock`) for simulated engines, where time
jumps to the next timer so hours of simulated training take seconds.

Config-time checks (each a :class:`ConfigError` saying what to change):
k > 0 needs behavior log-probs and a declared off-policy correction; every
column a stage consumes, the algorithm's included, must be produced by a
stage (:func:`~asyncflow_core.flow.pipeline.check_columns`); the store must
hold the rows the bound lets be in flight. The stages are built by
:mod:`asyncflow_core.flow.pipeline`, the roles declared by
:mod:`asyncflow_core.flow.roles`, the run supervised by
:mod:`asyncflow_core.flow.supervision`, and reported by
:mod:`asyncflow_core.flow.run_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from asyncflow_core import columns as C
from asyncflow_core.config.loader import ResolvedConfig
from asyncflow_core.config.redact import default_redactor, install_log_redaction, redact_config
from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_core.flow.canary import Canary
from asyncflow_core.flow.episode import build_episodes
from asyncflow_core.flow.checkpoint import Checkpointer, CheckpointState, latest_checkpoint
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.heap import freeze_startup, thaw
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.pipeline import PipelinePlan
from asyncflow_core.flow.roles import RoleSpec, Roles, run_roles
from asyncflow_core.flow.run_eval import attach_eval, finish_evals
from asyncflow_core.flow.run_report import StepLogger, run_summary, scalar_sinks, steady_rate, write_run_files
from asyncflow_core.flow.stage import FlowContext, RunStopped, Stage
from asyncflow_core.flow.staleness import TailPolicy, check_tail_policy
from asyncflow_core.flow.stages import RolloutStage
from asyncflow_core.flow.supervision import supervise, teardown
from asyncflow_core.flow.telemetry import MetricsWriter, Timeline
from asyncflow_core.flow.tokenizer import make_tokenizer, stop_token_ids, with_dataset_end
from asyncflow_core.interfaces import OffPolicyCorrection
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import SamplingParams

log = logging.getLogger("asyncflow.flow")

__all__ = ["FlowRuntime", "Roles", "check_off_policy", "run_flow"]

_steady_rate = steady_rate  # the name tests and benchmarks import


def check_off_policy(k: int, algorithm: Any) -> None:
    """Refuse k > 0 unless the algorithm reads behavior log-probs and declares a correction."""
    if k == 0:
        return
    if algorithm.correction is OffPolicyCorrection.NONE:
        raise ConfigError(
            f"async.max_staleness={k} trains on rows from older policies, but the algorithm declares no off-policy "
            "correction; set algorithm.options.correction (e.g. truncated_is or decoupled) or use async.mode: sync"
        )
    if C.BEHAVIOR_LOGPROBS not in algorithm.required_columns:
        raise ConfigError(
            f"async.max_staleness={k} needs behavior log-probs in the loss, but the algorithm does not read "
            f"{C.BEHAVIOR_LOGPROBS!r}; use an algorithm with an off-policy correction or async.mode: sync"
        )


def check_lora(cfg: Any, trainer: Any, replicas: list[Any]) -> None:
    """``trainer.lora`` needs a trainer that trains adapters and rollout engines that apply adapter-only updates."""
    if not getattr(trainer.features, "supports_lora", False):
        raise ConfigError(f"trainer.lora: trainer {cfg.trainer.name!r} does not support LoRA (supports_lora is false); "
                          "use trainer.name: fsdp, or unset trainer.lora")
    if replicas and not getattr(replicas[0].features, "supports_adapter_updates", False):
        raise ConfigError(f"trainer.lora: rollout engine {cfg.rollout.name!r} cannot apply adapter-only updates "
                          "(supports_adapter_updates is false); use rollout.name: torch or vllm, or unset trainer.lora")


class FlowRuntime:
    """One run: engines, store, stages, weight sync, telemetry."""

    def __init__(self, resolved: ResolvedConfig, *, run_dir: Path | None = None, progress: bool = False,
                 write_png: bool = True, resume: bool = False, roles: Roles | None = None,
                 on_start: Callable[[FlowContext], None] | None = None) -> None:
        self.roles = roles or Roles()
        #: called with the run's context once every built-in subscriber is attached, before the stages start
        #: (``asyncflow plan`` subscribes its cut-off there); it must not await, and what it attaches may stop the
        #: run (``ctx.halt``) but must not otherwise change it
        self.on_start = on_start
        self.resolved = resolved
        self.config = resolved.config
        self.run_dir = run_dir
        self.resume = resume
        if resume and run_dir is None:
            raise ConfigError("resuming needs the run directory of the run to continue")
        self.progress = progress
        self.write_png = write_png
        self.pm = get_plugin_manager()
        self.summary: dict[str, Any] = {}
        self.ctx: FlowContext | None = None
        self._plan: PipelinePlan | None = None

    def plan(self) -> PipelinePlan:
        """The algorithm (built once) and the plugin stages, and so which built-in stages and roles the run needs."""
        if self._plan is None:
            cfg = self.config
            algorithm = self._create("algorithm")
            check_off_policy(cfg.async_.k, algorithm)
            wrong = check_tail_policy(TailPolicy.from_config(cfg.async_), cfg.async_.k, algorithm.correction)
            if wrong is not None:
                raise ConfigError(wrong)
            reward_stage = self._plugin_stage("pipeline.replace.reward") if "reward" in cfg.pipeline.replace else None
            plugins = [self._plugin_stage(f"pipeline.stages[{i}]") for i in range(len(cfg.pipeline.stages))]
            self._plan = PipelinePlan(cfg, algorithm, plugins, reward_stage)
        return self._plan

    def role_specs(self) -> tuple[RoleSpec, ...]:
        """The run's roles as records (flow/roles.py): what a launcher places before the run starts."""
        return run_roles(self.config, needs_ref=self.plan().needs_ref)

    async def _restore(self, resume_from: tuple[Path, CheckpointState], trainer: Any, ctx: FlowContext,
                       step_log: StepLogger, rollout: RolloutStage, transport: Any) -> None:
        """Load the trainer's checkpoint and the sample accounting, then give every replica the restored weights."""
        path, state = resume_from
        await trainer.load(path / "trainer")
        if trainer.version != state.version:
            raise EngineError(f"checkpoint {path}: the trainer restored version {trainer.version}, "
                              f"the run state says {state.version}")
        await _restore_ledger(ctx, state)
        ctx.version = trainer.version
        step_log.tokens = state.tokens_trained
        await self._push_weights(trainer, ctx, rollout, transport, phase="weight push after resume")
        log.info("resumed from %s at version %d (%d prompts trained, %d dropped)", path, trainer.version,
                 len(state.trained), len(state.dropped))

    async def _push_weights(self, trainer: Any, ctx: FlowContext, rollout: RolloutStage, transport: Any, *,
                            phase: str = "initial weight push") -> None:
        """Stage the trainer's current weights and load them into every replica before anything is generated.

        A failure is one :class:`EngineError` line naming the phase, the engine and the error's type.
        """
        cfg = self.config
        try:
            report = await transport.send(
                trainer.export_weights(bucket_bytes=int(cfg.weight_transport.bucket_mb * (1 << 20))),
                deadline_s=cfg.weight_transport.deadline_s)
        except Exception as exc:  # noqa: BLE001 - one line saying where it failed, the original kept as the cause
            raise EngineError(f"{phase}: trainer {cfg.trainer.name!r} could not export or stage its weights "
                              f"({type(exc).__name__}: {exc})") from exc
        ctx.published = report.version
        rollout.weights_pushed = True
        for r in rollout.replicas:
            with ctx.timeline.span(r.lane, "update_weights"):
                try:
                    await rollout.load_weights(r, min_version=report.version)
                except Exception as exc:  # noqa: BLE001 - see above
                    if isinstance(exc, EngineError) and rollout.pool.restartable(r):
                        # a replaceable replica (a launcher's remote one) died here: the rollout stage restarts it
                        # and loads these weights into the new one before it generates anything
                        await rollout.replica_died(r, exc)
                        continue
                    raise EngineError(
                        f"{phase}: rollout engine {cfg.rollout.name!r} (replica {r.index}) failed to load the "
                        f"weights of trainer {cfg.trainer.name!r} ({type(exc).__name__}: {exc}); `asyncflow config "
                        "validate` checks that the two fit before a run") from exc

    def _inherited(self, section: str) -> dict[str, Any]:
        """Run-level settings an engine's options receive when they have the field and the user left it unset.

        Engines that load a real model declare a ``model`` option (the run's
        ``model`` section); trainers that score tokens declare ``temperature``
        / ``top_p`` / ``top_k`` and get the rollout's, so both sides use one
        log-prob convention.
        """
        cfg = self.config
        if section == "rollout":
            return {"model": cfg.model}
        if section == "trainer":
            return {"model": cfg.model, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k, "lora": cfg.trainer.lora}
        return {}

    def _create(self, section: str, *, role: str | None = None, index: int = 0, **update: Any) -> Any:
        comp = self.resolved.components[section]
        options = comp.options
        fields = getattr(type(options), "model_fields", {})
        explicit = getattr(options, "model_fields_set", set())
        inherit = {k: v for k, v in self._inherited(section).items() if k in fields and k not in explicit}
        update = {**inherit, **update}
        if update:
            options = options.model_copy(update={k: v for k, v in update.items() if k in fields})
        return self.roles.build(section, comp.registered.record.factory, options, role=role or section, index=index)

    def _replica_options(self, i: int) -> dict[str, Any]:
        """Replica ``i`` samples with its own seed (a ``sampling_seed`` option, else ``seed``); replica 0 as configured."""
        opts = self.resolved.components["rollout"].options
        fields = type(opts).model_fields
        for name in ("sampling_seed", "seed"):
            if i and name in fields:
                return {name: getattr(opts, name) + 7919 * i}
        return {}

    def _canary(self, rollout: RolloutStage, trainer: Any, lock: asyncio.Lock, sampling: SamplingParams,
                ctx: FlowContext) -> Canary | None:
        """The weights canary the ``canary`` section asks for (default: every 10 steps with a real model)."""
        cfg = self.config
        every = cfg.canary.interval(real_model=cfg.model.path is not None or cfg.model.hf_config is not None,
                                    lora=cfg.trainer.lora is not None)
        if not every:
            return None
        canary = Canary(every=every, samples=cfg.canary.samples, warn_above=cfg.canary.warn_above,
                        stop_above=cfg.canary.stop_above, replicas=rollout.replicas, trainer=trainer,
                        trainer_lock=lock, sampling=sampling, engine_name=cfg.rollout.name,
                        deadline_s=cfg.weight_transport.deadline_s, adapter=cfg.trainer.lora is not None)
        canary.bind(ctx)
        return canary

    def _plugin_stage(self, where: str) -> Stage:
        comp = self.resolved.components[where]
        stage = comp.registered.record.factory(comp.options)
        if not isinstance(stage, Stage):
            raise ConfigError(f"{where}: stage plugin {comp.registered.name!r} did not build a Stage "
                              f"(got {type(stage).__name__}); its factory must return a Stage subclass instance")
        return stage

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        loop = asyncio.get_running_loop()
        clock = loop.time
        k = cfg.async_.k
        B, n = cfg.data.prompts_per_step, cfg.rollout.n
        plan = self.plan()
        self.roles.declare(self.role_specs())
        if cfg.trainer.checkpoint_every and self.run_dir is None:
            raise ConfigError("trainer.checkpoint_every needs a run directory to write checkpoints into")
        resume_from = latest_checkpoint(self.run_dir) if self.resume else None
        store_opts = self.resolved.components["store"].options
        tail = TailPolicy.from_config(cfg.async_)
        need_rows = (k + 2) * B * n + tail.extra_rows(B, n)
        if getattr(store_opts, "capacity", need_rows) < need_rows:
            extra = " (+ async.overprovision x prompts_per_step x n)" if tail.overprovision else ""
            raise ConfigError(
                f"store.options.capacity={store_opts.capacity} cannot hold the {need_rows} rows that "
                f"(max_staleness + 2) x prompts_per_step x n{extra} may keep live; raise it to at least {need_rows}"
            )

        dataset = self._create("data")
        if len(dataset) == 0:
            raise ConfigError("the dataset is empty; point data.options at a file with prompts")
        cfg.model = with_dataset_end(cfg.model, dataset)  # the task's end marker ends completions (and is the EOS)
        special = cfg.model.special_token_problem()
        if special is not None:
            raise ConfigError(special)
        data_print = {"size": len(dataset), "seed": cfg.seed, "shuffle": cfg.data.shuffle, "epochs": cfg.data.epochs,
                      "prompts_per_step": B, "n": n}
        if resume_from is not None and resume_from[1].data != data_print:
            raise ConfigError(
                f"cannot resume from {resume_from[0]}: the data order changed (checkpoint {resume_from[1].data}, "
                f"now {data_print}); resume with the same dataset, seed, data.* settings and rollout.n"
            )
        dumped = cfg.model_dump(mode="json", by_alias=True)
        default_redactor().learn(dumped)  # its secrets, and the environment's, are scrubbed from every output
        install_log_redaction()
        if self.run_dir is not None:  # on resume too: the overrides given then (e.g. more steps) carry over
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(redact_config(dumped), sort_keys=False))
        tokenizer = make_tokenizer(cfg.model)
        store = self._create("store", clock=clock, group_size=n)
        transport = self._create("weight_transport")
        trainer = self._create("trainer")
        if plan.needs_values and not trainer.features.supports_values:
            raise ConfigError(
                f"algorithm {cfg.algorithm.name!r} reads value estimates, but trainer {cfg.trainer.name!r} has no "
                "value head; enable one in trainer.options (fsdp: value_head: true) or pick a critic-free algorithm"
            )
        replicas = [self._create("rollout", index=i, **self._replica_options(i)) for i in range(cfg.rollout.replicas)]
        if cfg.trainer.lora is not None:
            check_lora(cfg, trainer, replicas)
        reward = self._create("reward")
        ref_engine = self._create("trainer", role="ref") if plan.needs_ref else None

        timeline = Timeline(clock)
        ctx = FlowContext(store=store, timeline=timeline, ledger=Ledger(), k=k, prompts_per_step=B, n=n, clock=clock,
                          stale_policy=cfg.async_.stale_policy.value, tail=tail,
                          max_failure_rate=cfg.pipeline.max_failure_rate, lease_s=cfg.pipeline.lease_s,
                          counters=self.roles.counters)  # one set of counters: the launcher's events land there too
        self.ctx = ctx  #: the live run's shared state (version, ledger, counters), for launchers and tests
        metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if self.run_dir else None, append=self.resume)
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  stop_token_ids=stop_token_ids(cfg.model, tokenizer))
        episodes = build_episodes(self.resolved, tokenizer, stop_ids=sampling.stop_token_ids, reward=reward)
        pipe = plan.build(dataset=dataset, tokenizer=tokenizer, replicas=replicas, transport=transport,
                          sampling=sampling, reward=reward, trainer=trainer, ref_engine=ref_engine,
                          canary=lambda rollout, lock: self._canary(rollout, trainer, lock, sampling, ctx),
                          rollout_options={"episodes": episodes})
        stages, rollout, train = pipe.stages, pipe.rollout, pipe.train
        step_log = StepLogger(ctx, metrics, self.progress, cfg.trainer.total_steps,
                              sinks=scalar_sinks(cfg, self.run_dir))
        # VersionPublished subscribers after the context's wake-up (weight sync), in this order (flow/events.py)
        canary = train.canary
        if canary is not None:
            step_log.extras.append(canary.take_metrics)
            ctx.events.subscribe(VersionPublished, canary.published, name="canary")
        ctx.events.subscribe(VersionPublished, step_log.on_step, name="metrics")
        evals = attach_eval(self, ctx, rollout, reward, tokenizer, dataset, metrics, step_log, sampling, clock)
        if cfg.trainer.checkpoint_every:
            assert self.run_dir is not None
            ckpt = Checkpointer(self.run_dir, trainer, ctx.ledger, data_print, lambda: step_log.tokens,
                                every=cfg.trainer.checkpoint_every, total_steps=cfg.trainer.total_steps,
                                keep=cfg.trainer.keep_checkpoints, lock=pipe.trainer_lock, timeline=timeline)
            ctx.events.subscribe(VersionPublished, ckpt.on_version_published, name="checkpoint")

        async def start() -> None:
            await trainer.setup()
            if ref_engine is not None:
                await ref_engine.setup()
            for r in replicas:
                if cfg.trainer.lora is not None:  # before start: an engine may size its LoRA slots when it loads
                    r.configure_adapter(cfg.trainer.lora)
                await r.start()
            for st in stages:
                st.bind(ctx)
                await store.register_task(st.name, consumes=st.consumes, produces=st.produces)
            for st in stages:
                await st.setup()
            if resume_from is not None:
                await self._restore(resume_from, trainer, ctx, step_log, rollout, transport)
            elif cfg.model.path is not None or cfg.model.hf_config is not None:
                # real models: every replica starts from the trainer's weights, whatever seeds each side was given
                await self._push_weights(trainer, ctx, rollout, transport)
            step_log.started()  # step 1's width starts now, not before the engines' start-up
            freeze_startup()  # the start-up heap leaves the collector's full passes (flow/heap.py)

        async def stop(clean: bool) -> None:
            thaw()
            if clean and evals is not None:  # the rounds still open (the last version's), on the newest weights
                await finish_evals(evals, rollout, ctx, cfg.rollout.max_inflight)
            with contextlib.suppress(Exception):  # the environment pool's workers (multi-turn episodes)
                await episodes.close()
            await teardown(cfg, ctx, canary=canary, rollout=rollout, step_log=step_log, store=store,
                           transport=transport, replicas=replicas, reward=reward, trainer=trainer,
                           ref_engine=ref_engine, metrics=metrics, run_dir=self.run_dir, export=clean)

        if self.on_start is not None:
            self.on_start(ctx)
        wall0 = time.perf_counter()
        sim0 = clock()
        interrupted, error = await supervise(ctx, stages, start=start, stop=stop, lost=self.roles.lost)
        sim_s = clock() - sim0
        self.summary = run_summary(ctx, steps=trainer.version, sim0=sim0, sim_s=sim_s,
                                   wall_s=time.perf_counter() - wall0, step_log=step_log,
                                   staleness_hist=train.staleness_hist, k=k)
        if self.run_dir is not None:
            write_run_files(self.run_dir, self.summary, timeline, write_png=self.write_png, name=cfg.name,
                            title=f"{cfg.name}: {cfg.async_.mode.value} k={k}")
        if interrupted:
            raise KeyboardInterrupt
        if error is not None:
            raise error
        if ctx.stop_reason not in (None, "done") and not ctx.stop_reason.startswith("the prompt stream ended"):
            raise RunStopped(ctx.stop_reason)
        return self.summary


async def _restore_ledger(ctx: FlowContext, state: CheckpointState) -> None:
    led = ctx.ledger
    led.trained = set(state.trained)
    led.dropped = dict(state.dropped)
    led.admitted = len(led.trained) + len(led.dropped)
    led.counters.update(state.counters)


def run_flow(resolved: ResolvedConfig, *, virtual: bool = False, run_dir: Path | None = None,
             progress: bool = False, write_png: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run to completion on a fresh event loop (the virtual-clock loop when ``virtual``); returns the summary.

    ``resume``: continue the run in ``run_dir`` from its newest checkpoint.
    """
    runtime = FlowRuntime(resolved, run_dir=run_dir, progress=progress, write_png=write_png, resume=resume)
    if virtual:
        from asyncflow_core.flow.clock import run_virtual

        try:
            return run_virtual(runtime.run())
        finally:  # the run's graph is cyclic garbage: freed now, not at a rare full pass (run after run: calibration)
            del runtime
            gc.collect()
    return asyncio.run(runtime.run())

