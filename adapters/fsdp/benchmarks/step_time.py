"""Train-step time of the ``fsdp`` engine on the tiny Qwen2, world size 1 vs 2 (CPU, gloo). Prints a table.

    python adapters/fsdp/benchmarks/step_time.py [--rows 16] [--steps 10] [--worlds 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from asyncflow_core import columns as C
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_fsdp.testing import TINY_QWEN2, tiny_options


def make_batch(rows: int, prompt: int, response: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    vocab = TINY_QWEN2["vocab_size"]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (prompt,), generator=gen) for _ in range(rows)]),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(
            [torch.randint(0, vocab, (1 + (i * 7) % response,), generator=gen) for i in range(rows)]),
        C.REWARD: (torch.arange(rows) % 2).float(),
        C.GROUP_ID: torch.arange(rows) // 4,
    })


async def measure(world: int, rows: int, steps: int, budget: int, prompt: int, response: int) -> dict[str, float]:
    pm = get_plugin_manager()
    t0 = time.perf_counter()
    engine = pm.create("train_engine", "fsdp", tiny_options(world_size=world, micro_batch_tokens=budget))
    await engine.setup()
    setup_s = time.perf_counter() - t0
    algo = pm.create("algorithm", "grpo", {})
    try:
        batch = make_batch(rows, prompt, response)
        t0 = time.perf_counter()
        lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        logprobs_s = time.perf_counter() - t0
        batch = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: lp}))
        await engine.train_step(batch, algo)  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = await engine.train_step(batch, algo)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _ = [b async for b in engine.export_weights(bucket_bytes=1 << 20)]
        export_s = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    return {"world": world, "setup_s": setup_s, "logprobs_s": logprobs_s, "step_median_s": statistics.median(times),
            "step_min_s": min(times), "passes": metrics["micro_batches"], "tokens": metrics["tokens"],
            "export_s": export_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=32)
    args = parser.parse_args()
    rows = [asyncio.run(measure(int(w), args.rows, args.steps, args.budget, args.prompt, args.response))
            for w in args.worlds.split(",")]
    cols = list(rows[0])
    print(" | ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>13.4f}" if isinstance(r[c], float) else f"{r[c]:>13}" for c in cols))


if __name__ == "__main__":
    main()
