"""The flow runtime: builds a run's engines, store and stages from a resolved config and runs them.

``await FlowRuntime(resolved).run()`` runs on whatever event loop it is
awaited on. :func:`run_flow` picks the loop: a real one, or the virtual-clock
loop (:mod:`asyncflow_core.flow.clock`) for simulated engines, where time
jumps to the next timer so hours of simulated training take seconds.

Config-time checks (each a :class:`ConfigError` saying what to change):
k > 0 needs behavior log-probs and a declared off-policy correction; every
column the algorithm needs must be produced by a stage; the store must hold
the rows the bound lets be in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from asyncflow_core import columns as C
from asyncflow_core.config.loader import ResolvedConfig
from asyncflow_core.config.redact import default_redactor, install_log_redaction, redact_config
from asyncflow_core.errors import ConfigError, EngineError, UnsupportedFeatureError
from asyncflow_core.flow.canary import Canary
from asyncflow_core.flow.checkpoint import Checkpointer, CheckpointState, latest_checkpoint
from asyncflow_core.flow.events import VersionPublished
from asyncflow_core.flow.ledger import Ledger
from asyncflow_core.flow.stage import FlowContext, RunStopped, Stage
from asyncflow_core.flow.stages import (
    AdvantageStage,
    LogprobStage,
    PromptFeeder,
    RewardStage,
    RolloutStage,
    TrainStage,
)
from asyncflow_core.flow.telemetry import MetricsWriter, Timeline, gantt_png, reward_png
from asyncflow_core.flow.tokenizer import make_tokenizer, stop_token_ids, with_dataset_end
from asyncflow_core.interfaces import KVCachePolicy, OffPolicyCorrection
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, SamplingParams

log = logging.getLogger("asyncflow.flow")

#: columns the built-in stages produce
_PRODUCED = {C.PROMPT_IDS, C.GROUP_ID, C.RESPONSE_IDS, C.BEHAVIOR_LOGPROBS, C.RESPONSE_VERSIONS, C.TRUNCATED, C.REWARD,
             C.ADVANTAGES}


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


class Roles:
    """Where a run's components are built, and how the loss of one is reported.

    The ``local`` launcher uses this class itself: every component is built
    here, in this process, by its plugin's factory, and nothing can be lost
    out from under the run. Other launchers subclass it (the ``ray`` launcher
    builds engines and rewards as actors behind proxies with the same
    interfaces), so the runtime and the stages stay the same under every
    launcher.
    """

    def __init__(self) -> None:
        #: the run's counters (the runtime uses this very Counter): launcher events land in metrics and summary
        self.counters: Counter[str] = Counter()

    def build(self, section: str, factory: Any, options: Any, *, role: str, index: int = 0) -> Any:
        """The component of config section ``section`` (``role``: trainer or ref; ``index``: the replica)."""
        return factory(options)

    async def lost(self) -> None:
        """Raises when a role the run cannot go on without is gone; local roles never are."""
        await asyncio.Event().wait()


class FlowRuntime:
    """One run: engines, store, stages, weight sync, telemetry."""

    def __init__(self, resolved: ResolvedConfig, *, run_dir: Path | None = None, progress: bool = False,
                 write_png: bool = True, resume: bool = False, roles: Roles | None = None) -> None:
        self.roles = roles or Roles()
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

    async def _restore(self, resume_from: tuple[Path, CheckpointState], trainer: Any, ctx: FlowContext,
                       step_log: _StepLogger, rollout: RolloutStage, transport: Any) -> None:
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
                    if isinstance(exc, EngineError) and callable(getattr(r.engine, "restart", None)):
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
                    "top_k": cfg.rollout.top_k}
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
        every = cfg.canary.interval(real_model=cfg.model.path is not None or cfg.model.hf_config is not None)
        if not every:
            return None
        canary = Canary(every=every, samples=cfg.canary.samples, warn_above=cfg.canary.warn_above,
                        stop_above=cfg.canary.stop_above, replicas=rollout.replicas, trainer=trainer,
                        trainer_lock=lock, sampling=sampling, engine_name=cfg.rollout.name,
                        deadline_s=cfg.weight_transport.deadline_s)
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
        algorithm = self._create("algorithm")
        check_off_policy(k, algorithm)
        needs_old = C.OLD_LOGPROBS in algorithm.required_columns
        needs_ref = C.REF_LOGPROBS in algorithm.required_columns
        needs_values = C.VALUES in algorithm.required_columns
        produced = set(_PRODUCED) | ({C.OLD_LOGPROBS} if needs_old else set()) | ({C.REF_LOGPROBS} if needs_ref else set())
        produced |= {C.VALUES} if needs_values else set()
        missing = [c for c in algorithm.required_columns if c not in produced]
        if missing:
            raise ConfigError(f"algorithm {cfg.algorithm.name!r} needs columns no stage produces: {missing}")
        if cfg.trainer.checkpoint_every and self.run_dir is None:
            raise ConfigError("trainer.checkpoint_every needs a run directory to write checkpoints into")
        resume_from = latest_checkpoint(self.run_dir) if self.resume else None
        store_opts = self.resolved.components["store"].options
        need_rows = (k + 2) * B * n
        if getattr(store_opts, "capacity", need_rows) < need_rows:
            raise ConfigError(
                f"store.options.capacity={store_opts.capacity} cannot hold the {need_rows} rows that "
                f"(max_staleness + 2) x prompts_per_step x n may keep live; raise it to at least {need_rows}"
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
        if needs_values and not trainer.features.supports_values:
            raise ConfigError(
                f"algorithm {cfg.algorithm.name!r} reads value estimates, but trainer {cfg.trainer.name!r} has no "
                "value head; enable one in trainer.options (fsdp: value_head: true) or pick a critic-free algorithm"
            )
        replicas = [self._create("rollout", index=i, **self._replica_options(i)) for i in range(cfg.rollout.replicas)]
        reward = self._create("reward")
        ref_engine = self._create("trainer", role="ref") if needs_ref else None

        timeline = Timeline(clock)
        ctx = FlowContext(store=store, timeline=timeline, ledger=Ledger(), k=k, prompts_per_step=B, n=n, clock=clock,
                          stale_policy=cfg.async_.stale_policy.value,
                          max_failure_rate=cfg.pipeline.max_failure_rate)
        self.ctx = ctx  #: the live run's shared state (version, ledger, counters), for launchers and tests
        ctx.counters = self.roles.counters  # one set of counters: the launcher's events land in the metrics too
        metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if self.run_dir else None, append=self.resume)
        sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  stop_token_ids=stop_token_ids(cfg.model, tokenizer))
        colocated = bool(cfg.async_.colocated)
        rollout = RolloutStage(
            replicas, transport, sampling, max_inflight=cfg.rollout.max_inflight,
            rows_per_lease=cfg.rollout.rows_per_lease, lease_s=cfg.pipeline.lease_s,
            write_interval_s=cfg.pipeline.write_interval_s, deadline_s=cfg.weight_transport.deadline_s,
            kv_cache=KVCachePolicy(cfg.rollout.kv_cache),
        )
        stages: list[Stage] = [
            PromptFeeder(dataset, tokenizer, epochs=cfg.data.epochs, shuffle=cfg.data.shuffle, seed=cfg.seed,
                         max_prompts=cfg.trainer.total_steps * B),
            rollout,
            RewardStage(reward, tokenizer, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s),
        ]
        stages[2].batch_size = cfg.pipeline.reward_batch
        stages[2].reward_name = cfg.reward.name
        if "reward" in cfg.pipeline.replace:
            stages[2] = self._plugin_stage("pipeline.replace.reward")
            if C.REWARD not in stages[2].produces:
                raise ConfigError(f"pipeline.replace.reward: stage {stages[2].name!r} must produce the 'reward' column")
        extra = [self._plugin_stage(f"pipeline.stages[{i}]") for i in range(len(cfg.pipeline.stages))]
        names = [st.name for st in stages + extra]
        if len(set(names)) != len(names):
            raise ConfigError(f"stage names must be unique (they are store task names); got {names}")
        available = set(_PRODUCED)
        for st in extra:
            missing_in = [c for c in st.consumes if c not in available | {c2 for o in extra for c2 in o.produces}]
            if missing_in:
                raise ConfigError(f"stage {st.name!r} consumes {missing_in}, which no stage produces")
            produced |= set(st.produces)
        stages.extend(extra)
        if needs_ref:
            stages.append(LogprobStage("ref", C.REF_LOGPROBS, ref_engine, batch_size=cfg.pipeline.logprob_batch))
        if needs_old or needs_values:
            # one forward pass gives the proximal log-probs and the value estimates before the step
            trainer_lock = asyncio.Lock()
            stages.append(LogprobStage("old", C.OLD_LOGPROBS if needs_old else None, trainer,
                                       batch_size=cfg.pipeline.logprob_batch, values=needs_values, lock=trainer_lock))
        adv_inputs = [c for c in algorithm.required_columns if c != C.ADVANTAGES]
        adv_inputs += [c for st in extra for c in st.produces]  # every added stage sees a sample first
        # a lease takes every whole group that is ready, up to one step's worth (partial: it never waits for
        # more): one store round trip per batch of groups, which an actor-backed store (ray) pays per call
        stages.append(AdvantageStage(algorithm, adv_inputs, n=n, groups_per_lease=B))
        step_log = _StepLogger(ctx, metrics, self.progress, cfg.trainer.total_steps, sinks=_sinks(cfg, self.run_dir))
        train = TrainStage(
            trainer, algorithm, transport, rollout, consumes=adv_inputs, total_steps=cfg.trainer.total_steps,
            bucket_bytes=int(cfg.weight_transport.bucket_mb * (1 << 20)), deadline_s=cfg.weight_transport.deadline_s,
            colocated=colocated,
        )
        train.sampler = cfg.sampler.name
        if needs_old or needs_values:
            train.engine_lock = trainer_lock
        stages.append(train)
        # VersionPublished subscribers after the context's wake-up (weight sync), in this order (flow/events.py)
        canary = self._canary(rollout, trainer, train.engine_lock, sampling, ctx)
        if canary is not None:
            train.canary = canary
            step_log.extras.append(canary.take_metrics)
            ctx.events.subscribe(VersionPublished, canary.published, name="canary")
        ctx.events.subscribe(VersionPublished, step_log.on_step, name="metrics")
        if cfg.trainer.checkpoint_every:
            assert self.run_dir is not None
            ckpt = Checkpointer(self.run_dir, trainer, ctx.ledger, data_print, lambda: step_log.tokens,
                                every=cfg.trainer.checkpoint_every, total_steps=cfg.trainer.total_steps,
                                keep=cfg.trainer.keep_checkpoints, lock=train.engine_lock, timeline=timeline)
            ctx.events.subscribe(VersionPublished, ckpt.on_version_published, name="checkpoint")

        wall0 = time.perf_counter()
        sim0 = clock()
        interrupted = False
        error: BaseException | None = None
        tasks: dict[asyncio.Future, Stage | None] = {}
        try:
            await trainer.setup()
            if ref_engine is not None:
                await ref_engine.setup()
            for r in replicas:
                await r.start()
            for st in stages:
                st.bind(ctx)
                st.lease_s = cfg.pipeline.lease_s
                await store.register_task(st.name, consumes=st.consumes, produces=st.produces)
            for st in stages:
                await st.setup()
            if resume_from is not None:
                await self._restore(resume_from, trainer, ctx, step_log, rollout, transport)
            elif cfg.model.path is not None or cfg.model.hf_config is not None:
                # real models: every replica starts from the trainer's weights, whatever seeds each side was given
                await self._push_weights(trainer, ctx, rollout, transport)
            step_log.started()  # step 1's width starts now, not before the engines' start-up
            tasks.update({asyncio.ensure_future(st.run()): st for st in stages})
            stop_task = asyncio.ensure_future(ctx.stop.wait())
            tasks[stop_task] = None
            tasks[asyncio.ensure_future(self.roles.lost())] = None  # raises when a role the run needs is gone
            pending = set(tasks)
            while pending and not ctx.stop.is_set():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is stop_task or t.cancelled():
                        continue
                    exc = t.exception()
                    if exc is not None:
                        raise exc
                if not any(tasks[t] is not None for t in pending):
                    break
        except (KeyboardInterrupt, asyncio.CancelledError):
            interrupted = True
            ctx.halt("interrupted")
        except BaseException as exc:  # noqa: BLE001 - reported after the telemetry is written
            error = exc
            ctx.halt(f"{type(exc).__name__}: {exc}")
        finally:
            # stop every stage before closing what they use, and collect their exceptions (none left unretrieved)
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
            if canary is not None:
                await canary.close()
            rollout.close_spans()
            step_log.close()
            await _quietly(store.close())
            await _quietly(transport.close())
            for r in replicas:
                await _quietly(r.shutdown())
            if asyncio.iscoroutinefunction(getattr(reward, "shutdown", None)):  # a remote reward pool
                await _quietly(reward.shutdown())
            if cfg.trainer.export_final and self.run_dir is not None and error is None and not interrupted \
                    and trainer.version > 0:
                try:
                    await trainer.export_pretrained(self.run_dir / "final_model")
                except UnsupportedFeatureError:
                    pass
                except Exception as exc:  # noqa: BLE001 - the run's results are already safe
                    log.warning("final export failed: %s: %s", type(exc).__name__, exc)
            await _quietly(trainer.shutdown())
            if ref_engine is not None:
                await _quietly(ref_engine.shutdown())
            metrics.close()
        sim_s = clock() - sim0
        wall_s = time.perf_counter() - wall0
        trained_samples = len(ctx.ledger.trained) * n
        self.summary = {
            "steps": int(trainer.version),
            "stop_reason": ctx.stop_reason,
            "run_seconds": sim_s,
            "wall_seconds": wall_s,
            "samples_trained": trained_samples,
            "samples_per_s": trained_samples / sim_s if sim_s > 0 else 0.0,
            "steady_samples_per_s": _steady_rate(step_log.step_ends),
            "step_end_s": [round(t - sim0, 6) for t, _ in step_log.step_ends],
            "tokens_trained": step_log.tokens,
            "staleness_histogram": {str(k_): v for k_, v in sorted(train.staleness_hist.items())},
            "max_staleness": k,
            "ledger": ctx.ledger.summary(),
            "counters": {k_: int(v) for k_, v in sorted(ctx.counters.items())},
            "utilisation": timeline.utilisation(sim0, sim0 + sim_s),
        }
        self.summary = default_redactor().value(self.summary)  # a stop reason may quote a secret
        if self.run_dir is not None:
            timeline.write(self.run_dir)
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
            if self.write_png and (self.run_dir / "metrics.jsonl").exists():
                reward_png(self.run_dir / "metrics.jsonl", self.run_dir / "reward.png", title=f"{cfg.name}: mean reward")
            if self.write_png:
                gantt_png(timeline.spans and [s.__class__(s.lane, s.name, s.start - timeline.t0, s.end - timeline.t0)
                                              for s in timeline.spans] or [], self.run_dir / "timeline.png",
                          title=f"{cfg.name}: {cfg.async_.mode.value} k={k}")
        if interrupted:
            raise KeyboardInterrupt
        if error is not None:
            raise error
        if ctx.stop_reason not in (None, "done") and not ctx.stop_reason.startswith("the prompt stream ended"):
            raise RunStopped(ctx.stop_reason)
        return self.summary


def _reward_extras(ctx: FlowContext, batch: Batch) -> dict[str, float]:
    """Means over the step's rows of the extra values a reward returned (e.g. ``correct`` beside a shaped reward)."""
    if not ctx.reward_extra or batch.row_ids is None:
        return {}
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for row in batch.row_ids.tolist():
        for key, v in ctx.reward_extra.pop(int(row), {}).items():
            sums[key] += v
            counts[key] += 1
    return {key: sums[key] / counts[key] for key in sorted(sums)}


def _steady_rate(step_ends: list[tuple[float, int]]) -> float | None:
    """Samples/s from the end of the first step to the end of the last: throughput without the pipeline fill.

    A pipelined run spends its first step filling the pipeline (nothing to
    train until the first batch is generated); a long run amortises that to
    nothing, so this is the figure a long run sees. None with fewer than two steps.
    """
    if len(step_ends) < 2 or step_ends[-1][0] <= step_ends[0][0]:
        return None
    return sum(n for _, n in step_ends[1:]) / (step_ends[-1][0] - step_ends[0][0])


async def _restore_ledger(ctx: FlowContext, state: CheckpointState) -> None:
    led = ctx.ledger
    led.trained = set(state.trained)
    led.dropped = dict(state.dropped)
    led.admitted = len(led.trained) + len(led.dropped)
    led.counters.update(state.counters)


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - teardown must reach every component
        log.warning("teardown: %s: %s", type(exc).__name__, exc)


class _StepLogger:
    """Per-step metrics (JSONL) and the live progress display."""

    def __init__(self, ctx: FlowContext, writer: MetricsWriter, progress: bool, total: int,
                 sinks: list[Any] | None = None) -> None:
        self.ctx = ctx
        self.sinks = sinks or []
        self.writer = writer
        self.tokens = 0
        self.total = total
        self.step_ends: list[tuple[float, int]] = []  #: (clock at the end of each step, samples it trained)
        self.extras: list[Any] = []  #: callables returning more figures for the step's record (the canary's)
        self._last_end = ctx.clock()
        self._last_counters: Counter[str] = Counter()
        self._progress = None
        self._task = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn())
            self._progress.start()
            self._task = self._progress.add_task("steps", total=total, info="")

    def started(self) -> None:
        self._last_end = self.ctx.clock()

    async def on_step(self, event: VersionPublished) -> None:
        """The step's metrics record (a ``VersionPublished`` subscriber)."""
        ctx = self.ctx
        version, batch, metrics, report, lag = event.step, event.batch, event.metrics, event.report, event.lag
        now = ctx.clock()
        resp = batch[C.RESPONSE_IDS]
        prompt = batch[C.PROMPT_IDS]
        tokens = int(resp.numel_packed + prompt.numel_packed)  # type: ignore[union-attr]
        self.tokens += tokens
        width = now - self._last_end
        counters = Counter({k: v for k, v in ctx.counters.items()})
        counters.update(ctx.ledger.counters)
        delta = {k: int(v - self._last_counters.get(k, 0)) for k, v in counters.items() if v != self._last_counters.get(k, 0)}
        self._last_counters = counters
        hist = Counter(lag.tolist())
        extra = _reward_extras(ctx, batch)
        util = ctx.timeline.utilisation(self._last_end, now)
        record = {
            "step": version + 1,
            "time_s": now - ctx.timeline.t0,
            "step_seconds": width,
            "reward_mean": float(batch[C.REWARD].float().mean()),
            **{f"reward/{k}": v for k, v in extra.items()},
            "samples": batch.num_rows,
            "tokens": tokens,
            "tokens_per_s": tokens / width if width > 0 else 0.0,
            "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
            "weight_sync_s": report.seconds,
            "weight_bytes": report.bytes,
            "events": delta,
            "utilisation": {k: round(v, 4) for k, v in sorted(util.items())},
            **{f"train/{k}": float(v) for k, v in metrics.items()},
            **{k: v for extra_fn in self.extras for k, v in extra_fn().items()},
        }
        self.writer.write(record)
        self.step_ends.append((now, batch.num_rows))
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        for sink in self.sinks:
            sink(version + 1, scalars)
        self._last_end = now
        if self._progress is not None:
            self._progress.update(self._task, completed=version + 1,
                                  info=f"reward {record['reward_mean']:.3f}  {record['tokens_per_s']:.0f} tok/s")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _sinks(cfg: Any, run_dir: Path | None) -> list[Any]:
    """Optional scalar sinks: TensorBoard event files and W&B, each only when asked for and installed."""
    sinks: list[Any] = []
    if cfg.logging.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("logging.tensorboard needs the tensorboard package: pip install tensorboard") from exc
        writer = SummaryWriter(str((run_dir or Path(".")) / "tensorboard"))
        sinks.append(lambda step, scalars: [writer.add_scalar(k, v, step) for k, v in scalars.items()])
    if cfg.logging.wandb_project:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError("logging.wandb_project needs wandb: pip install wandb") from exc
        wandb.init(project=cfg.logging.wandb_project, name=cfg.name,
                   config=redact_config(cfg.model_dump(mode="json", by_alias=True)))
        sinks.append(lambda step, scalars: wandb.log(scalars, step=step))
    return sinks


def run_flow(resolved: ResolvedConfig, *, virtual: bool = False, run_dir: Path | None = None,
             progress: bool = False, write_png: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run to completion on a fresh event loop (the virtual-clock loop when ``virtual``); returns the summary.

    ``resume``: continue the run in ``run_dir`` from its newest checkpoint.
    """
    runtime = FlowRuntime(resolved, run_dir=run_dir, progress=progress, write_png=write_png, resume=resume)
    if virtual:
        from asyncflow_core.flow.clock import run_virtual

        return run_virtual(runtime.run())
    return asyncio.run(runtime.run())
