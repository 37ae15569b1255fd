"""The simulator's speed-ups change no decision: seeded small workloads keep the schedule digests they had before.

``benchmarks/sim_scaling.py``'s ``schedule_digest`` hashes a run's whole
summary but its wall time (step end times, staleness histogram, ledger,
counters, utilisation). The digests below were recorded on the tree before
the simulator speed-ups of issue 19's third round (docs/simulation.md,
"Simulator speed"), with the same calls; a change that moves any simulated
event changes them. A deliberate change of the schedule (a new latency model,
a new summary field) must record them again and say why in its commit: recorded
again when the trajectory writer began putting a lease's last row at the end of
the event-loop turn, not after its ``write_interval_s`` timer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams
from asyncflow_plugins.sim import rollout as sim_rollout

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("sim_scaling", REPO / "benchmarks" / "sim_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_scaling"] = mod
    spec.loader.exec_module(mod)
    return mod


#: (devices, mode, measured steps, payload) -> (digest, groups re-queued), recorded before the change
RECORDED = {
    (16, "one_step", 2, "lengths"): ("546585bdd4328a25", 29),
    (16, "one_step", 2, "tokens"): ("546585bdd4328a25", 29),  # the full-token payload: the same schedule
    (16, "async2", 2, "lengths"): ("021ecd066cf67f21", 40),
    (16, "sync", 2, "lengths"): ("9c298ea4f9917c6d", 0),
}


@pytest.mark.parametrize("key", sorted(RECORDED), ids=lambda k: "-".join(map(str, k)))
def test_a_seeded_workload_keeps_its_recorded_schedule(key):
    devices, mode, steps, payload = key
    row = _load().run_one(devices, mode, steps, 16, payload=payload)
    assert row["violations"] == 0
    assert (row["schedule_digest"], row["requeued"]) == RECORDED[key]


def _generate(prompts: list[tuple[int, ...]], vocab_size: int) -> list:
    async def body():
        engine = sim_rollout.SimRolloutEngine(sim_rollout.SimRolloutConfig(time_scale=1e-3, vocab_size=vocab_size))
        await engine.start()
        try:
            reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=16)) for i, p in enumerate(prompts)]
            out = {r.request_id: r async for r in engine.generate(reqs)}
            return [out[f"r{i}"] for i in range(len(prompts))]
        finally:
            await engine.shutdown()

    return asyncio.run(body())


def test_the_remembered_vocabulary_check_still_refuses_a_prompt_outside_a_smaller_vocabulary():
    """A prompt found inside one vocabulary is remembered for that size only; another engine with a smaller
    vocabulary still refuses it, and a refused prompt is never remembered as valid."""
    sim_rollout._PROMPTS_IN_VOCAB.clear()
    prompt = (1, 2, 40)
    ok = _generate([prompt, prompt], vocab_size=50)
    assert [r.finish_reason for r in ok] != [FinishReason.ERROR] * 2 and all(r.error is None for r in ok)
    assert sim_rollout._PROMPTS_IN_VOCAB[prompt] == 50
    bad = _generate([prompt, (1, 2, 40)], vocab_size=30)  # the same prompt, then an equal copy of it
    assert all(r.finish_reason is FinishReason.ERROR and "outside the vocabulary" in r.error for r in bad)
    assert sim_rollout._PROMPTS_IN_VOCAB[prompt] == 50  # the refusal did not overwrite what was found
    assert [r.error for r in _generate([(-1, 2)], vocab_size=50)][0] is not None
    assert (-1, 2) not in sim_rollout._PROMPTS_IN_VOCAB
