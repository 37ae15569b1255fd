"""Helpers for tests of the ``megatron`` engine (here and in projects that build on it).

``TINY_QWEN2`` is a randomly initialised two-layer Qwen2 small enough to run
on a CPU in milliseconds; :func:`cpu_options` runs the engine on gloo with
megatron-core's CUDA-only calls patched in the ranks (:mod:`asyncflow_megatron.cpu`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

TINY_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 48,
    "max_position_embeddings": 128,
}


def cpu_options(**overrides: Any) -> dict[str, Any]:
    """Options of a ``megatron`` engine on :data:`TINY_QWEN2` on the CPU: one thread per rank, a visible lr."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "device": "cpu", "params_dtype": "float32",
            "use_distributed_optimizer": False,
            "start_method": "forkserver", "cpu_threads_per_rank": 1, "lr": 1e-2, **overrides}


def gpu_options(**overrides: Any) -> dict[str, Any]:
    """Options of a ``megatron`` engine on :data:`TINY_QWEN2` on CUDA (float32 so results compare exactly)."""
    return {"model": {"hf_config": dict(TINY_QWEN2)}, "device": "cuda", "params_dtype": "float32", "lr": 1e-2,
            **overrides}


@contextlib.contextmanager
def _parameters_report_cuda_types() -> Iterator[None]:
    """While megatron builds its optimizer: ``tensor.type()`` names the CUDA type of a CPU tensor.

    megatron-core's DistributedOptimizer sorts parameters by ``param.type()``
    and refuses anything but ``torch.cuda.*Tensor``; nothing else in it needs
    CUDA once :mod:`asyncflow_megatron.cpu` is on. This stands in for the GPU
    this machine lacks, during the optimizer's construction only.
    """
    original = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def distributed_optimizer_phase(phase: str, directory: str, lr: float = 1e-2) -> None:
    """One world-1 rank with megatron-core's DistributedOptimizer on the CPU (torch AdamW): a test's half round trip.

    Runs in its own process (spawned by a test). ``phase`` ``"save"``: one
    step, save to ``directory``, a second step. ``"load"``: a fresh rank loads
    ``directory``, then takes the same second step. Each writes
    ``{phase}.pt``: the log-probs after the second step and each
    parameter's Adam step (value and tensor identity) after the load or the
    first step. The CPU test path does not offer the distributed optimizer
    (``device: cpu`` refuses it); this builds the rank directly, with
    :func:`_parameters_report_cuda_types` around the optimizer's construction.
    """
    import pickle
    from pathlib import Path

    import megatron.core.optimizer as mopt

    from asyncflow_core import columns as C
    from asyncflow_core.interfaces import LossContext
    from asyncflow_core.launchers.packing import plan_step
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import Batch, RaggedTensor
    from asyncflow_megatron.config import MegatronTrainConfig
    from asyncflow_megatron.worker import RankWorker

    build = mopt.get_megatron_optimizer

    def build_reporting_cuda(*args: Any, **kwargs: Any) -> Any:
        with _parameters_report_cuda_types():
            return build(*args, **kwargs)

    mopt.get_megatron_optimizer = build_reporting_cuda
    options = cpu_options(lr=lr, micro_batch_tokens=64)
    config = MegatronTrainConfig.model_validate(options).model_copy(update={"use_distributed_optimizer": True})
    worker = RankWorker(0, 1, config)
    worker.op_setup({"port": worker.op_bind(None)})
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = TINY_QWEN2["vocab_size"]
        rows = 6
        batch = Batch({
            C.PROMPT_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (2 + i % 3,), generator=gen)
                                                       for i in range(rows)]),
            C.RESPONSE_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (1 + (2 * i) % 4,), generator=gen)
                                                         for i in range(rows)]),
            C.REWARD: (torch.arange(rows) % 3 == 0).float(),
            C.GROUP_ID: torch.arange(rows) // 3,
        })
        lengths = batch[C.PROMPT_IDS].lengths + batch[C.RESPONSE_IDS].lengths
        micro = plan_step(lengths, 1, 64).rank_micro_batches[0]
        algo = get_plugin_manager().create("algorithm", "grpo", {})

        def logprobs() -> torch.Tensor:
            return torch.cat(worker.op_logprobs({"batch": batch, "micro_batches": micro}))

        def step(version: int) -> None:
            # behaviour log-probs of the current weights: every token keeps a gradient (no clipped ratios)
            lp = RaggedTensor(logprobs(), batch[C.RESPONSE_IDS].offsets)
            train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
            ctx = LossContext(global_tokens=train[C.RESPONSE_IDS].numel_packed, global_sequences=rows,
                              policy_version=version)
            worker.op_train({"batch": train, "micro_batches": micro, "ctx": ctx, "algorithm": pickle.dumps(algo)})

        def adam_steps() -> list[tuple[float, int]]:
            inner = worker.optimizer.chained_optimizers[0].optimizer
            return [(float(s["step"]), id(s["step"])) for s in inner.state.values()]

        if phase == "save":
            step(0)
            steps = adam_steps()
            worker.op_save({"path": directory, "version": 1})
        else:
            worker.op_load({"path": directory})
            steps = adam_steps()
        step(1)
        torch.save({"logprobs": logprobs(), "steps": steps, "optimizer": type(worker.optimizer.chained_optimizers[0])
                    .__name__}, Path(directory) / f"{phase}.pt")
    finally:
        worker.close()


def sample_batch(rows: int = 7, seed: int = 0, prompt_len: int | None = None, response_len: int | None = None) -> Any:
    """Rows of uneven prompt and response lengths on :data:`TINY_QWEN2`'s vocabulary (fixed lengths when given)."""
    from asyncflow_core import columns as C
    from asyncflow_core.types import Batch, RaggedTensor

    gen = torch.Generator().manual_seed(seed)
    vocab = TINY_QWEN2["vocab_size"]
    prompts = [torch.randint(0, vocab, (prompt_len or 2 + i % 4,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, vocab, (response_len or 1 + (3 * i) % 5,), generator=gen) for i in range(rows)]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
        C.REWARD: (torch.arange(rows) % 3 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


async def fresh_engine_round_trip(options: dict[str, Any], directory: Any) -> dict[str, Any]:
    """Step, save, step on one engine; a NEW engine loads the checkpoint and takes the same second step.

    Returns the log-probs at the start, after the writer's second step
    (``continued``) and after the new engine's (``resumed``), the exported
    weights after each second step, and the version the new engine loaded.
    Equal results mean the optimizer state (Adam's moments and step count)
    came back, not only the weights.
    """
    from pathlib import Path

    from asyncflow_core import columns as C
    from asyncflow_core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    algo = pm.create("algorithm", "grpo", {})
    batch = sample_batch()
    path = Path(directory) / "ckpt"

    async def step(engine: Any) -> None:
        # behaviour log-probs of the current weights: no token is clipped, every step has a gradient
        lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        await engine.train_step(algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp})), algo)

    async def weights(engine: Any) -> dict[str, torch.Tensor]:
        return {name: t.float().clone() for b in [b async for b in engine.export_weights(bucket_bytes=1 << 20)]
                for name, t in b.tensors()}

    out: dict[str, Any] = {}
    writer = pm.create("train_engine", "megatron", options)
    await writer.setup()
    try:
        out["start"] = (await writer.compute_logprobs(batch))[C.LOGPROBS].values
        await step(writer)
        await writer.save(path)
        await step(writer)
        out["continued"] = (await writer.compute_logprobs(batch))[C.LOGPROBS].values
        out["continued_weights"] = await weights(writer)
    finally:
        await writer.shutdown()
    fresh = pm.create("train_engine", "megatron", options)
    await fresh.setup()
    try:
        await fresh.load(path)
        out["version"] = fresh.version
        await step(fresh)
        out["resumed"] = (await fresh.compute_logprobs(batch))[C.LOGPROBS].values
        out["resumed_weights"] = await weights(fresh)
    finally:
        await fresh.shutdown()
    return out
