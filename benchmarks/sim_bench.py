"""How fast the simulated rollout engines run on the virtual clock: replicas x requests -> wall seconds.

    .venv/bin/python benchmarks/sim_bench.py --replicas 8,32,128 --requests 512
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncflow_core.types import GenerationRequest, SamplingParams
from asyncflow_core.flow.clock import run_virtual
from asyncflow_plugins.sim.rollout import SimRolloutConfig, SimRolloutEngine


async def simulate(replicas: int, requests: int, max_new_tokens: int) -> dict[str, float]:
    engines = [SimRolloutEngine(SimRolloutConfig(seed=i)) for i in range(replicas)]
    for engine in engines:
        await engine.start()
    params = SamplingParams(max_new_tokens=max_new_tokens)

    async def drive(i: int, engine: SimRolloutEngine) -> int:
        reqs = [GenerationRequest(f"{i}-{j}", (1,) * 256, params) for j in range(requests)]
        return sum([len(r.token_ids) async for r in engine.generate(reqs)])

    wall = time.perf_counter()
    tokens = sum(await asyncio.gather(*(drive(i, e) for i, e in enumerate(engines))))
    wall = time.perf_counter() - wall
    simulated = asyncio.get_running_loop().time()
    events = sum(e.stats.events for e in engines)
    busy = sum(e.busy_seconds for e in engines) / (replicas * simulated)
    for engine in engines:
        await engine.shutdown()
    return {"simulated_s": simulated, "wall_s": wall, "tokens": tokens, "events": events, "busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="8,32,128", help="comma-separated replica counts")
    parser.add_argument("--requests", type=int, default=512, help="requests per replica")
    parser.add_argument("--max-new-tokens", type=int, default=8192)
    args = parser.parse_args()
    print("| replicas | requests | tokens | events | simulated s | wall s | busy fraction |")
    print("|---|---|---|---|---|---|---|")
    for replicas in (int(r) for r in args.replicas.split(",")):
        row = run_virtual(simulate(replicas, args.requests, args.max_new_tokens))
        print(
            f"| {replicas} | {replicas * args.requests} | {row['tokens']:.3g} | {row['events']} | "
            f"{row['simulated_s']:.1f} | {row['wall_s']:.2f} | {row['busy']:.3f} |"
        )


if __name__ == "__main__":
    main()
