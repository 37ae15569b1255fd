"""``asyncflow eval RUN_DIR [--checkpoint STEP]``: evaluate a run's weights alone, pinned to their version.

The weights come from a checkpoint (``--checkpoint STEP``, default the newest)
loaded by the configured train engine and pushed through the configured
weight transport into the configured rollout engine, exactly as a run pushes
them; a run without checkpoints is evaluated from ``final_model/`` when it
has one and its config loads a checkpoint by ``model.path``. The run's
``eval`` section (or one given as overrides) says what to evaluate. Results
go to ``RUN_DIR/eval.jsonl`` (one record per evaluation, tagged
``eval_version``), ``RUN_DIR/eval.png``, and a table on stdout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from asyncflow_core.errors import ConfigError


def _weights(run_dir: Path, checkpoint: int | None, cfg: Any) -> tuple[str, Path, int]:
    """``("checkpoint", dir, version)`` or ``("final_model", dir, version)``; a one-line error when there is none."""
    from asyncflow_core.flow.checkpoint import CheckpointState, checkpoint_root, latest_checkpoint, step_dir

    root = checkpoint_root(run_dir)
    have = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    if checkpoint is not None:
        path = step_dir(run_dir, checkpoint)
        if not (path / "state.json").is_file():
            raise ConfigError(f"--checkpoint {checkpoint}: {run_dir} has no checkpoint of step {checkpoint}; it has "
                              f"{', '.join(map(str, have)) or 'none'}")
        return "checkpoint", path, CheckpointState.from_json((path / "state.json").read_text()).version
    if have:
        path, state = latest_checkpoint(run_dir)
        return "checkpoint", path, state.version
    final = run_dir / "final_model"
    if final.is_dir():
        if cfg.model.path is None:
            raise ConfigError(f"{run_dir} has no checkpoint, and its final_model/ has no tokenizer for a run "
                              "without model.path; run with trainer.checkpoint_every > 0 to evaluate it")
        summary = run_dir / "summary.json"
        steps = json.loads(summary.read_text()).get("steps", 0) if summary.is_file() else 0
        return "final_model", final, int(steps)
    raise ConfigError(f"{run_dir} has neither checkpoints nor final_model/; run with trainer.checkpoint_every > 0 "
                      "(or trainer.export_final: true) to have weights to evaluate")


async def evaluate_run(run_dir: Path, overrides: list[str], checkpoint: int | None) -> dict[str, Any]:
    """Evaluate the chosen weights of ``run_dir``; returns the eval record (also appended to eval.jsonl)."""
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.flow.engine_pool import EnginePool
    from asyncflow_core.flow.eval import EvalRequests, Evaluator, eval_sampling, load_eval_sets, make_round, run_pinned
    from asyncflow_core.flow.runtime import FlowRuntime
    from asyncflow_core.flow.telemetry import MetricsWriter
    from asyncflow_core.flow.tokenizer import make_tokenizer, stop_token_ids
    from asyncflow_core.flow.weight_follower import WeightFollower, WeightPolicy
    from asyncflow_core.interfaces import KVCachePolicy

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; give the run directory of an asyncflow run")
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml; give the run directory of an asyncflow run")
    cfg = load_config(saved, overrides)
    if cfg.eval is None:
        raise ConfigError(f"{saved} has no eval section; add one to the run config, or give it as an override, "
                          "e.g. 'eval={datasets: [{options: {path: held_out.jsonl, answer_key: answer}}]}'")
    source, where, version = _weights(run_dir, checkpoint, cfg)
    if source == "final_model":
        cfg.model = cfg.model.model_copy(update={"path": str(where)})
    resolved = resolve(cfg)
    runtime = FlowRuntime(resolved)
    tokenizer = make_tokenizer(cfg.model)
    dataset = runtime._create("data")
    sets = load_eval_sets(resolved, tokenizer, dataset)
    sampling = eval_sampling(cfg.eval, cfg.rollout, stop_token_ids(cfg.model, tokenizer))
    engine = runtime._create("rollout")
    reward = runtime._create("reward")
    trainer = transport = None
    writer = MetricsWriter(run_dir / "eval.jsonl", append=True)
    try:
        await engine.start()
        if source == "checkpoint":
            trainer = runtime._create("trainer")
            transport = runtime._create("weight_transport")
            await trainer.setup()
            await trainer.load(where / "trainer")
            await transport.send(trainer.export_weights(bucket_bytes=int(cfg.weight_transport.bucket_mb * (1 << 20))),
                                 deadline_s=cfg.weight_transport.deadline_s)
            pool = EnginePool([engine], max_inflight=cfg.rollout.max_inflight)
            follower = WeightFollower(transport, pool, deadline_s=cfg.weight_transport.deadline_s,
                                      kv_cache=KVCachePolicy(cfg.rollout.kv_cache), policy=WeightPolicy.PINNED,
                                      pinned_version=trainer.version)
            await follower.load(pool[0])
            if engine.version != version:
                raise ConfigError(f"{where}: the rollout engine reports version {engine.version} after loading "
                                  f"the checkpoint of version {version}")
        evaluator = Evaluator(reward, tokenizer, cfg.eval, writer=writer, run_dir=run_dir,
                              timeout_s=cfg.reward.timeout_s)
        evaluator.tags["weights"] = f"{source} {where}"
        queue = EvalRequests(sampling, max_inflight=cfg.rollout.max_inflight, priority=1.0,
                             on_complete=evaluator.evaluate)
        rnd = make_round(engine.version, sets, cfg.eval.samples_per_prompt)
        rnd.label_version = version  # final_model: the engine calls its loaded weights 0; they are `version`
        queue.add(rnd)
        await run_pinned([engine], queue, max_inflight=cfg.rollout.max_inflight)
    finally:
        writer.close()
        for part in (engine, transport, trainer):
            if part is not None:
                try:
                    await part.shutdown() if hasattr(part, "shutdown") else await part.close()
                except Exception as exc:  # noqa: BLE001 - teardown
                    logging.getLogger("asyncflow").warning("teardown: %s: %s", type(exc).__name__, exc)
    return evaluator.records[-1]


def eval_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run's directory (holds config.yaml and checkpoints/).")],
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. eval.samples_per_prompt=4.")] = None,
    checkpoint: Annotated[int | None, typer.Option(
        help="Evaluate this step's checkpoint (default: the newest).")] = None,
) -> None:
    """Evaluate a finished run, or any of its checkpoints, on its eval section; results tagged with the version."""
    from rich.console import Console
    from rich.table import Table

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    record = asyncio.run(evaluate_run(run_dir, overrides or [], checkpoint))
    table = Table(title=f"eval of version {record['eval_version']}", caption=f"weights: {record['weights']}")
    for col in ("set", "metric", "value"):
        table.add_column(col)
    for key, value in record.items():
        if key.startswith("eval/") and key.count("/") == 2:
            _, label, metric = key.split("/")
            table.add_row(label, metric, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console(width=200).print(table)
    Console(stderr=True).print(f"wrote {run_dir / 'eval.jsonl'} and {run_dir / 'eval.png'}")
