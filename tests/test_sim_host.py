"""The shared host of the sim engines: processor sharing of busy periods on the virtual clock, hand-computed."""

import asyncio

import pytest

from asyncflow_core.errors import EngineError
from asyncflow_core.flow.clock import run_virtual
from asyncflow_core.types import GenerationRequest, RewardInput, SamplingParams
from asyncflow_plugins.sim.host import SimHost, SimHostShare, host_for
from asyncflow_plugins.sim.latency import RolloutLatency, TrainLatency
from asyncflow_plugins.sim.rollout import LENGTH_METADATA_KEY, SimRolloutConfig, SimRolloutEngine
from asyncflow_plugins.sim.train import SimTrainConfig, SimTrainEngine
from asyncflow_plugins.sim.workload import SimReward, SimRewardConfig


async def _ends(host: SimHost, jobs: list[tuple[float, float, float]]) -> list[float]:
    """Finish times of ``(start, work, demand)`` jobs spent on ``host``."""
    loop = asyncio.get_running_loop()

    async def job(start, work, demand):
        await asyncio.sleep(start)
        await host.spend(work, demand)
        return loop.time()

    return await asyncio.gather(*(job(*j) for j in jobs))


def test_two_engines_that_fill_the_host_split_it_in_proportion_to_their_demands():
    """Capacity 2, demands 2 and 3, efficiency 0.8: together A runs at 0.8 x 2/5 = 0.32 of its speed alone and
    B at 0.32 / (2/3) = 0.48. A: 1 s of work from 0; B: 1 s from 0.5.
    A alone to 0.5 (0.5 done); together A needs 0.5 / 0.32 = 1.5625 more -> 2.0625, B has done 0.75 by then;
    B alone for the last 0.25 -> 2.3125."""

    async def body():
        return await _ends(SimHost("h", 2.0, 0.8), [(0.0, 1.0, 2.0), (0.5, 1.0, 3.0)])

    assert run_virtual(body()) == pytest.approx([2.0625, 2.3125], abs=1e-9)


def test_demands_inside_the_capacity_slow_nothing_and_oversubscription_shares_equally():
    """Capacity 2: two activities of 1 core run as if alone; three share 2 cores (rate 2/3 each)."""

    async def body():
        alone = await _ends(SimHost("h", 2.0), [(0.0, 1.0, 1.0), (0.0, 1.0, 1.0)])
        t0 = asyncio.get_running_loop().time()
        three = await _ends(SimHost("h", 2.0), [(0.0, 1.0, 1.0)] * 3)
        return alone, [t - t0 for t in three]

    alone, three = run_virtual(body())
    assert alone == pytest.approx([1.0, 1.0]) and three == pytest.approx([1.5] * 3)


def test_a_replica_and_a_trainer_on_one_host_each_take_twice_as_long_as_alone():
    """A replica (100 decoding steps of 10 ms: 1 s alone) and a train step of 1 s, both demanding the whole host,
    start together: each progresses at half speed, both end at 2 s; without a host both end at 1 s. A request
    that arrives at 0.5 s (batch 2 from then on, same step time) joins at the step boundary."""
    lat = RolloutLatency(step_overhead_s=0.01, weight_read_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.0)
    train = TrainLatency(devices=1, params=1.0, mfu=1.0, peak_flops_per_device=6.0, step_overhead_s=0.0)

    def req(rid, length):
        return GenerationRequest(rid, (1, 2), SamplingParams(max_new_tokens=1000),
                                 metadata={LENGTH_METADATA_KEY: length})

    async def body(share):
        loop = asyncio.get_running_loop()
        replica = SimRolloutEngine(SimRolloutConfig(latency=lat, machine=share))
        trainer = SimTrainEngine(SimTrainConfig(latency=train, machine=share))
        await replica.start()
        await trainer.setup()

        async def generate(rid, length, at):
            await asyncio.sleep(at)
            return [(loop.time(), r) async for r in replica.generate([req(rid, length)])][0]

        async def spend():
            await trainer._spend(1.0)
            return loop.time()

        out = await asyncio.gather(generate("A", 100, 0.0), generate("B", 10, 0.5), spend())
        await replica.shutdown()
        return [t for t, _ in out[:2]] + [out[2]], replica

    (a, b, t), replica = run_virtual(body(SimHostShare(capacity=1.0, demand=1.0)))
    # B joins at 0.5 s (25 steps of A done at half speed) and ends 10 steps later: 0.7 s
    assert (a, b, t) == pytest.approx((2.0, 0.7, 2.0), abs=1e-6)
    assert replica.busy_seconds == pytest.approx(1.0)  # work, not wall time
    (a, b, t), _ = run_virtual(body(None))
    assert (a, b, t) == pytest.approx((1.0, 0.6, 1.0), abs=1e-6)


def test_sim_reward_scoring_takes_its_share_of_the_host():
    """Scoring 5 samples at 0.1 s each (0.5 s alone) beside 1 s of other work, both demanding the whole host:
    both run at half speed, so scoring ends at 1.0 s and the other work at 1.5 s."""
    share = SimHostShare(capacity=1.0, demand=1.0)

    async def body():
        reward = SimReward(SimRewardConfig(seconds_per_sample=0.1, machine=share))
        loop = asyncio.get_running_loop()

        async def other():
            await host_for(share).spend(1.0, 1.0)
            return loop.time()

        task = asyncio.create_task(other())
        samples = [RewardInput(prompt=f"p{i}", completion="") for i in range(5)]
        scores = await reward.score_many(samples, 10.0)
        return loop.time(), await task, scores

    scored, other, scores = run_virtual(body())
    assert (scored, other) == pytest.approx((1.0, 1.5), abs=1e-9)
    assert len(scores) == 5 and all(ok for ok, _ in scores)


def test_engines_that_disagree_on_the_host_are_refused_in_one_line():
    async def body():
        host_for(SimHostShare(name="h", capacity=2.0, demand=1.0))
        with pytest.raises(EngineError, match="give every engine on it the same host options"):
            host_for(SimHostShare(name="h", capacity=4.0, demand=1.0))
        assert host_for(SimHostShare(name="h", capacity=2.0, demand=3.0)) is host_for(
            SimHostShare(name="h", capacity=2.0, demand=1.0))

    run_virtual(body())


def test_busy_periods_on_one_thread_take_turns_and_the_thread_counts_once_on_the_host():
    """Capacity 2, demand 1 each, 1 s of work each from 0. Two on thread "t" and one of its own: the thread counts
    as one activity of demand 1, so the host (demand 2) is not contended; the thread's two busy periods take turns
    (rate 1/2 each) and end at 2 s, the third runs as if alone (1 s). Without the thread the three share 2 cores
    (rate 2/3): all end at 1.5 s. Turns while the other arrives: A (1 s of work from 0) and B (0.25 s from 0.5),
    both on the thread: A alone to 0.5, both at 1/2 until B is done at 1.0, A's last 0.25 alone -> 1.25.
    The host counts as contended (two activities, more demand than cores) only while the three share it."""

    async def ends(host, jobs):
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def job(start, work, thread):
            await asyncio.sleep(start)
            await host.spend(work, 1.0, thread=thread)
            return loop.time() - t0

        return await asyncio.gather(*(job(*j) for j in jobs))

    async def body():
        hosts = [SimHost("h", 2.0) for _ in range(3)]
        turns = await ends(hosts[0], [(0.0, 1.0, "t"), (0.0, 1.0, "t"), (0.0, 1.0, None)])
        shared = await ends(hosts[1], [(0.0, 1.0, None)] * 3)
        arriving = await ends(hosts[2], [(0.0, 1.0, "t"), (0.5, 0.25, "t")])
        return turns, shared, arriving, [x for h in hosts for x in (h.busy_seconds, h.contended_seconds)]

    turns, shared, arriving, seconds = run_virtual(body())
    assert turns == pytest.approx([2.0, 2.0, 1.0], abs=1e-9)
    assert shared == pytest.approx([1.5] * 3, abs=1e-9)
    assert arriving == pytest.approx([1.25, 1.0], abs=1e-9)
    assert seconds == pytest.approx([2.0, 0.0, 1.5, 1.5, 1.25, 0.0], abs=1e-9)  # busy, contended per host


def test_two_replicas_on_one_thread_take_as_long_as_one_doing_both_batches():
    """Two sim replicas, 100 decoding steps of 10 ms each (1 s alone), on a 2-core host where each demands 1 core:
    in their own processes both end at 1 s; on one thread (the driver's interpreter) they take turns, 2 s."""
    lat = RolloutLatency(step_overhead_s=0.01, weight_read_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.0)

    async def body(thread):
        loop = asyncio.get_running_loop()
        share = SimHostShare(capacity=2.0, demand=1.0, thread=thread)
        replicas = [SimRolloutEngine(SimRolloutConfig(latency=lat, machine=share)) for _ in range(2)]
        for r in replicas:
            await r.start()

        async def generate(r, rid):
            req = GenerationRequest(rid, (1, 2), SamplingParams(max_new_tokens=1000),
                                    metadata={LENGTH_METADATA_KEY: 100})
            return [loop.time() async for _ in r.generate([req])][0]

        t0 = loop.time()
        out = await asyncio.gather(generate(replicas[0], "A"), generate(replicas[1], "B"))
        for r in replicas:
            await r.shutdown()
        return [t - t0 for t in out]

    assert run_virtual(body(None)) == pytest.approx([1.0, 1.0], abs=1e-6)
    assert run_virtual(body("driver")) == pytest.approx([2.0, 2.0], abs=1e-6)
