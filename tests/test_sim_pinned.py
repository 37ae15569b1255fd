"""A seeded 64-device simulation gives the schedule it gave before the simulator was optimised.

The expected figures were recorded from the code *before* the speed-ups of
issue 19 (kept eligibility masks in the store, cached result versions, the
sim engine's lengths-only fast paths), on ``benchmarks/sim_scaling.py``'s 64-device
``one_step`` and ``async2`` runs (lengths-only payload, 2 measured steps
after the warm-up). Optimisations must not change a single decision: step
end times, staleness histogram, ledger and counters are compared as
recorded.

Recorded again once, deliberately, when the trajectory writer began putting a
lease's last row at the end of the event-loop turn instead of after its
``write_interval_s`` timer (rows reach the store earlier, so later decisions
move); the simulator's own code was unchanged then.

Step ends are compared to 1e-4 s: the summary rounds them to 1e-6 s, and
any change of schedule moves a step end by at least one decoding step of a
replica (>= 6 ms with the default latency: 1.5 ms overhead + 4.5 ms weight
read), so the tolerance only absorbs floating-point noise.
"""

from __future__ import annotations

import pytest

from asyncflow_core.config.loader import resolve
from asyncflow_core.config.models import RunConfig
from asyncflow_core.flow.runtime import run_flow

# recorded before the optimisation, and again for the writer's change (see the module docstring)
EXPECTED = {
    "one_step": {
        "step_end_s": [60.047289, 85.470727, 151.760894, 216.408247],
        "staleness_histogram": {"0": 1901, "1": 2195},
        "ledger": {"admitted": 512, "dropped": 0, "requeued_stale": 141, "trained": 512, "unfinished": 0},
        "counters": {"aborted_stale": 197, "prompts_started": 653, "requeued_stale_rollout": 197,
                     "tokens_generated": 10543361, "weight_updates": 120},
        "samples_trained": 4096,
        "tokens_trained": 10889857,
    },
    "async2": {
        "step_end_s": [56.017051, 79.947594, 100.653327, 148.924387, 224.935058],
        "staleness_histogram": {"0": 1128, "1": 1752, "2": 2240},
        "ledger": {"admitted": 640, "dropped": 0, "requeued_stale": 157, "trained": 640, "unfinished": 0},
        "counters": {"aborted_stale": 67, "prompts_started": 797, "requeued_stale_rollout": 67,
                     "tokens_generated": 13134722, "weight_updates": 160},
        "samples_trained": 5120,
        "tokens_trained": 13419775,
    },
}


def _config(mode: str) -> RunConfig:
    """``sim_scaling.config(64, mode, steps, 16)`` written out: 40 rollout replicas, a 24-device trainer."""
    k = 1 if mode == "one_step" else 2
    async_cfg = {"mode": "one_step"} if mode == "one_step" else {"mode": "async", "max_staleness": 2}
    steps = k + 1 + 2  # the warm-up (k + 1 steps) and 2 measured steps
    prompts = 128  # 16 samples per device x 64 devices / n = 8
    return RunConfig.model_validate({
        "name": f"sim-64-{mode}",
        "data": {"name": "sim", "options": {"size": prompts * (steps + k + 2), "prompt_tokens": 512},
                 "prompts_per_step": prompts, "shuffle": False},
        "rollout": {"name": "sim", "replicas": 40, "n": 8, "max_new_tokens": 8192, "max_inflight": 256,
                    "rows_per_lease": 256, "kv_cache": "keep", "options": {"payload": "lengths"}},
        "trainer": {"name": "sim", "options": {"latency": {"devices": 24}}, "total_steps": steps},
        "store": {"name": "inprocess", "options": {"capacity": 65536}},
        "weight_transport": {"name": "sim"},
        "algorithm": {"name": "grpo", "options": {"group_size": 8}},
        "reward": {"name": "sim", "workers": 1},
        "pipeline": {"reward_batch": 1024, "write_interval_s": 0.5},
        "async": {**async_cfg, "colocated": False},
        "logging": {"level": "WARNING"},
    })


@pytest.mark.parametrize("mode", ["one_step", "async2"])
def test_a_seeded_64_device_run_keeps_its_recorded_schedule(mode):
    s = run_flow(resolve(_config(mode)), virtual=True, write_png=False)
    want = EXPECTED[mode]
    assert s["step_end_s"] == pytest.approx(want["step_end_s"], abs=1e-4)
    assert s["staleness_histogram"] == want["staleness_histogram"]
    assert s["ledger"] == want["ledger"]
    assert {k: s["counters"].get(k) for k in want["counters"]} == want["counters"]
    assert s["samples_trained"] == want["samples_trained"] and s["tokens_trained"] == want["tokens_trained"]


# ------------------------------------------------------------ the version range the sim engine records


def test_the_version_range_an_engine_records_is_the_range_of_its_versions():
    """The sim engine hands results their (min, max) version without a scan; it must equal the scan's."""
    import asyncio

    from asyncflow_core.flow.clock import run_virtual
    from asyncflow_core.types import GenerationRequest, SamplingParams
    from asyncflow_plugins.sim.rollout import LENGTH_METADATA_KEY, SimRolloutConfig, SimRolloutEngine
    from asyncflow_plugins.sim.train import SimTrainConfig, SimTrainEngine

    def req(rid: str, n: int, prefix: tuple[int, ...] = ()) -> GenerationRequest:
        return GenerationRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=1000), prefix_token_ids=prefix,
                                 prefix_logprobs=(-0.5,) * len(prefix), prefix_versions=tuple(range(len(prefix))),
                                 metadata={LENGTH_METADATA_KEY: n})

    async def body(payload: str) -> list:
        engine = SimRolloutEngine(SimRolloutConfig(payload=payload))
        await engine.start()
        trainer = SimTrainEngine(SimTrainConfig())
        await trainer.setup()

        async def collect():
            return [r async for r in engine.generate([req("a", 400), req("b", 300, (7, 8, 9)), req("c", 2)])]

        task = asyncio.ensure_future(collect())
        for version in (2, 5):  # two in-flight updates: results span up to three versions
            await asyncio.sleep(0.5)
            trainer._version = version
            await engine.update_weights(version, trainer.export_weights(bucket_bytes=1 << 20))
        out = await task
        await engine.shutdown()
        return out

    for payload in ("tokens", "lengths"):
        results = run_virtual(body(payload))
        assert {r.request_id for r in results} == {"a", "b", "c"}
        assert any(r.min_version != r.max_version for r in results)  # the updates landed mid-generation
        for r in results:
            scan = r.versions.tolist()
            assert (r.min_version, r.max_version) == (min(scan), max(scan))
