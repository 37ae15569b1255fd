"""The latency model's numbers: the defaults land where docs/simulation.md says they do."""

import math
import random

import pytest

from asyncflow_plugins.sim.latency import (
    LatencyModel,
    ResponseLengths,
    RolloutLatency,
    TrainLatency,
    TransferLatency,
)


def test_every_field_is_described_and_unknown_fields_are_refused():
    for model in (LatencyModel, ResponseLengths, RolloutLatency, TrainLatency, TransferLatency):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
        with pytest.raises(ValueError):
            model(no_such_field=1)


def test_decode_step_grows_with_the_batch_and_throughput_saturates():
    lat = RolloutLatency()
    steps = [lat.step_time(b) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps) and len(set(steps)) == 4
    # single stream: ~6 ms per token (~160 tokens/s), the memory-bound floor of a 7B model on one H100
    assert 0.004 < lat.step_time(1) < 0.010
    # full batch: several thousand tokens/s per device
    assert 4_000 < lat.decode_throughput(256) < 12_000
    assert lat.decode_throughput(256) > 20 * lat.decode_throughput(1)


def test_tensor_parallelism_speeds_up_less_than_linearly():
    one = RolloutLatency()
    two = RolloutLatency(devices_per_replica=2)
    assert one.step_time(64) / 2 < two.step_time(64) < one.step_time(64)
    assert two.kv_capacity_tokens == 2 * one.kv_capacity_tokens
    assert two.prefill_time(1000) < one.prefill_time(1000)


def test_response_lengths_have_the_configured_median_and_a_long_tail():
    lengths = ResponseLengths()
    rng = random.Random(0)
    draws = sorted(lengths.draw(rng.random(), 8192)[0] for _ in range(20_000))
    median = draws[len(draws) // 2]
    assert median == pytest.approx(1500, rel=0.05)
    capped = sum(d == 8192 for d in draws) / len(draws)
    expected = 1 - lengths.cdf(8191)  # P(uncapped length >= 8192), about 3%
    assert capped == pytest.approx(expected, abs=0.005)
    assert 0.01 < capped < 0.06
    # a long tail: p95 is several times the median, the mean above the median
    assert draws[int(0.95 * len(draws))] > 4 * median
    assert sum(draws) / len(draws) > median


def test_capped_draws_say_so():
    lengths = ResponseLengths()
    assert lengths.draw(0.999999, 100) == (100, True)
    n, capped = lengths.draw(0.5, 100_000)
    assert not capped and n == math.ceil(1500)


def test_resumed_lengths_are_conditioned_on_the_prefix_and_keep_the_original_when_possible():
    lengths = ResponseLengths()
    rng = random.Random(1)
    for _ in range(2000):
        u = rng.random()
        prefix = rng.randrange(1, 6000)
        n, _ = lengths.draw(u, 16384, longer_than=prefix)
        assert n > prefix
        original, _ = lengths.draw(u, 16384)
        if original > prefix:
            assert n == original, "a resumed request whose original length exceeds its prefix keeps that length"
    # the conditional distribution: of responses longer than 3000, the median is above the unconditional one
    resumed = sorted(lengths.draw(rng.random(), 1 << 20, longer_than=3000)[0] for _ in range(5000))
    assert resumed[0] > 3000 and resumed[len(resumed) // 2] > 3000


def test_train_step_time_follows_six_n_d_over_mfu():
    lat = TrainLatency()
    tokens = 1_000_000
    compute = 6 * 7.6e9 * tokens / (8 * 989e12 * 0.35)
    assert lat.train_time(tokens) == pytest.approx(compute + lat.step_overhead_s)
    assert lat.forward_time(tokens) == pytest.approx(compute / 3 + lat.forward_overhead_s)
    # a 512-sample GRPO batch of ~2.5k tokens each: tens of seconds per step on one node
    assert 10 < lat.train_time(512 * 2500) < 60


def test_weight_transfer_of_a_bf16_7b_model_takes_about_a_second():
    lat = TransferLatency()
    assert lat.model_bytes == pytest.approx(15.2e9)
    assert lat.send_time() == pytest.approx(0.1 + 15.2e9 / 20e9)
    assert 0.5 < lat.receive_time() < 3
    assert lat.send_time(1e9) < lat.send_time()
