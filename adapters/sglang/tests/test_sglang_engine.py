"""Tests of the ``sglang`` rollout engine against the protocol fake (asyncflow_sglang.testing), not a real SGLang.

SGLang has no CPU build, so the server here is a child process speaking
SGLang's HTTP routes with a toy bigram model (see the fake's docstring). The
engine's code paths are the real ones: HTTP, error handling, abort races,
pause modes, and weight updates by torch.distributed broadcast (gloo on
127.0.0.1) into the fake, whose sampling reads the weights.

CI runs these through tests/adapters/test_sglang.py.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch
from asyncflow_spec import RolloutEngineSpec

from asyncflow_core.errors import AsyncflowError, ConfigError, EngineError, WeightTransferError
from asyncflow_core.interfaces import PauseMode
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, WeightBucket
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_core.types.weights import pack_buckets
from asyncflow_sglang.testing import fake_command, fake_server, toy_weights

VOCAB = 32
SEED = 0


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def shared_fake():
    with fake_server("--random-seed", str(SEED), "--vocab-size", str(VOCAB), "--step-ms", "4",
                     "--enable-memory-saver") as server:
        yield server


@pytest.fixture
def fake(shared_fake):
    shared_fake.reset()
    yield shared_fake
    shared_fake.reset()


def make(url: str, **options):
    return get_plugin_manager().create("rollout_engine", "sglang", {"url": url, **options})


def request(rid: str, prompt=(1, 2, 3), **sampling) -> GenerationRequest:
    params = {"max_new_tokens": 8, **sampling}
    return GenerationRequest(rid, tuple(prompt), SamplingParams(**params))


async def collect(stream):
    return [r async for r in stream]


async def until(predicate, timeout: float = 20.0, what: str = "condition"):
    """Poll ``predicate`` (a cheap call to the fake) until true; the fake runs in another process."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ conformance


class TestSGLangSpec(RolloutEngineSpec):
    """The conformance suite against the protocol fake (a url known only once the fake runs)."""

    backend = "sglang"
    max_new_tokens = 8
    held_new_tokens = 300  # the fake streams a token every ~2 ms: the pause lands well before 300
    options = {"weight_sync": {"backend": "gloo", "group_timeout_s": 60.0}}

    def weights(self):
        """The fake's model with other values: the spec's weight-update tests broadcast them over gloo."""
        return toy_weights(VOCAB, SEED + 1)

    @pytest.fixture
    def make_backend(self, fake):
        pm = get_plugin_manager()

        def build(**overrides):
            return pm.create(self.kind, self.backend, {"url": fake.url, **self.options, **overrides})

        return build


# ------------------------------------------------------------------ generate


def test_tokens_and_logprobs_match_the_served_model(fake):
    """Every token's log-prob is log_softmax(logits / T) of the toy model at that position (an independent oracle)."""
    weights = toy_weights(VOCAB, SEED)

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"o{i}", prompt=(i + 1, 5), max_new_tokens=12, temperature=0.7, seed=i) for i in range(4)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body())
    assert len(results) == 4
    sent = fake.state()["bodies"]["/generate"]
    assert sent["return_logprob"] is True and sent["sampling_params"]["temperature"] == 0.7
    for res in results:
        assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 12
        previous = [res.prompt_token_ids[-1], *res.token_ids[:-1]]
        logits = weights["lm_head.weight"][previous] + weights["lm_head.bias"]
        expected = sampling_logprobs(logits, 0.7).gather(1, torch.tensor(res.token_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.logprobs), expected, atol=1e-5, rtol=1e-5)
        assert set(res.versions) == {0}
        assert res.metadata["sglang_weight_version"] == "default"


def test_stop_token_ends_with_stop_and_is_included(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"s{i}", max_new_tokens=400, stop_token_ids=tuple(range(0, VOCAB, 2)), seed=i)
                    for i in range(3)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    for res in run(body()):
        assert res.finish_reason is FinishReason.STOP
        assert res.token_ids[-1] % 2 == 0 and all(t % 2 for t in res.token_ids[:-1])


def test_resumed_prefix_is_continued_and_returned(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            req = GenerationRequest("p", (1, 2), SamplingParams(max_new_tokens=6), prefix_token_ids=(4, 5),
                                    prefix_logprobs=(-0.5, -0.25), prefix_versions=(3, 3))
            (res,) = await collect(engine.generate([req]))
            return res
        finally:
            await engine.shutdown()

    res = run(body())
    sent = fake.state()["bodies"]["/generate"]
    assert sent["input_ids"] == [1, 2, 4, 5] and sent["sampling_params"]["max_new_tokens"] == 4
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 6
    assert tuple(res.token_ids[:2]) == (4, 5) and tuple(res.logprobs[:2]) == (-0.5, -0.25)
    assert tuple(res.versions) == (3, 3, 0, 0, 0, 0)


def test_truncated_sampling_is_refused_unless_asked_for(fake):
    """top_p < 1: SGLang's log-probs are not renormalised, so the request fails with the reason by default."""

    async def body(**options):
        engine = make(fake.url, **options)
        await engine.start()
        try:
            return await collect(engine.generate([request("t", top_p=0.8), request("u")]))
        finally:
            await engine.shutdown()

    by_id = {r.request_id: r for r in run(body())}
    assert by_id["t"].finish_reason is FinishReason.ERROR and "truncated_logprobs" in by_id["t"].error
    assert by_id["u"].finish_reason is FinishReason.LENGTH
    by_id = {r.request_id: r for r in run(body(truncated_logprobs="server"))}
    assert by_id["t"].finish_reason is FinishReason.LENGTH


# ------------------------------------------------------------------ failures


def test_connection_refused_is_an_engine_error_naming_the_route():
    from asyncflow_sglang.launch import free_port

    engine = make(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2.0)
    with pytest.raises(EngineError, match=r"GET http://127\.0\.0\.1:\d+/get_server_info.*ConnectError"):
        run(engine.start())


def test_a_500_answer_fails_that_request_alone(fake):
    fake.faults(generate_status=500, generate_message="CUDA error: device-side assert", times=1)

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            results = await collect(engine.generate([request("a"), request("b")]))
            return results, await engine.health()
        finally:
            await engine.shutdown()

    results, health = run(body())
    errors = [r for r in results if r.finish_reason is FinishReason.ERROR]
    assert len(errors) == 1 and len(results) == 2
    assert "/generate with 500: CUDA error: device-side assert" in errors[0].error
    assert health.ok


def test_a_timeout_fails_the_request_and_a_dead_health_fails_the_engine(fake):
    async def body():
        engine = make(fake.url, request_timeout_s=0.3, control_timeout_s=2.0)
        await engine.start()
        try:
            fake.faults(generate_delay_s=1.0)
            (res,) = await collect(engine.generate([request("slow")]))
            assert res.finish_reason is FinishReason.ERROR and "within 0.3s" in res.error
            assert (await engine.health()).ok
            fake.faults(generate_delay_s=1.0, unhealthy=True)
            with pytest.raises(EngineError, match="/health failed too"):
                await collect(engine.generate([request("slow2")]))
            assert not (await engine.health()).ok
        finally:
            await engine.shutdown()

    run(body())


def test_server_dying_mid_generation_fails_the_engine():
    """A killed server ends every generate stream with EngineError (the runtime re-queues the replica's work)."""

    async def body(server):
        engine = make(server.url)
        await engine.start()
        try:
            reqs = [request(f"d{i}", max_new_tokens=100_000) for i in range(3)]
            task = asyncio.ensure_future(collect(engine.generate(reqs)))
            await until(lambda: len(server.state()["running"]) == 3, what="requests to run")
            await asyncio.to_thread(server.kill)
            with pytest.raises(EngineError, match="lost the SGLang server"):
                await task
            assert not (await engine.health()).ok
            with pytest.raises(EngineError):
                await collect(engine.generate([request("after")]))
        finally:
            await engine.shutdown()

    with fake_server("--vocab-size", str(VOCAB)) as server:
        run(body(server))


# ------------------------------------------------------------------ abort and pause


def test_abort_returns_partial_tokens(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"a{i}", max_new_tokens=100_000) for i in range(2)]
            task = asyncio.ensure_future(collect(engine.generate(reqs)))
            await until(lambda: fake.state()["progress"].get("a0", 0) >= 3, what="a0 to have 3 tokens")
            assert await engine.abort(["a0", "missing"]) == ["a0"]
            await until(lambda: "a0" not in fake.state()["running"], what="a0 to be aborted")
            assert await engine.abort(None) == ["a1"]
            return await task
        finally:
            await engine.shutdown()

    by_id = {r.request_id: r for r in run(body())}
    assert {r.finish_reason for r in by_id.values()} == {FinishReason.ABORT}
    assert 3 <= len(by_id["a0"].token_ids) < 100_000
    assert len(by_id["a0"].token_ids) == len(by_id["a0"].logprobs) == len(by_id["a0"].versions)


def test_pause_abort_holds_new_requests_until_resume(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            first = asyncio.ensure_future(collect(engine.generate([request("x", max_new_tokens=100_000)])))
            await until(lambda: "x" in fake.state()["running"], what="x to run")
            await engine.pause(PauseMode.ABORT)
            assert fake.state()["paused"] == "abort"
            (res,) = await first
            assert res.finish_reason is FinishReason.ABORT
            sent_before = fake.state()["counts"]["/generate"]
            held = asyncio.ensure_future(collect(engine.generate([request("y")])))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not held.done() and fake.state()["counts"]["/generate"] == sent_before  # held here, not sent
            await engine.resume()
            (res,) = await held
            assert res.finish_reason is FinishReason.LENGTH and fake.state()["paused"] is None
        finally:
            await engine.shutdown()

    run(body())


@pytest.mark.parametrize("keep_mode", ["in_place", "retract"])
def test_pause_keep_holds_requests_on_the_server(fake, keep_mode):
    async def body():
        engine = make(fake.url, keep_mode=keep_mode)
        await engine.start()
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("k", max_new_tokens=60)])))
            await until(lambda: fake.state()["progress"].get("k", 0) >= 1, what="k to start")
            await engine.pause(PauseMode.KEEP)
            state = fake.state()
            assert state["paused"] == keep_mode
            await asyncio.sleep(0.1)  # long enough for ~25 toy steps, had the server not paused
            assert fake.state()["progress"]["k"] == state["progress"]["k"] and not task.done()
            await engine.resume()
            (res,) = await task
            assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 60
        finally:
            await engine.shutdown()

    run(body())


def test_pause_wait_returns_when_in_flight_requests_finish(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("w", max_new_tokens=20)])))
            await until(lambda: "w" in fake.state()["running"], what="w to run")
            await engine.pause(PauseMode.WAIT)
            assert task.done() and (await task)[0].finish_reason is FinishReason.LENGTH
            assert fake.state()["paused"] is None  # nothing was asked of the server
            await engine.resume()
        finally:
            await engine.shutdown()

    run(body())


def test_sleep_and_wake_release_and_resume_memory(fake):
    async def body():
        engine = make(fake.url, memory_saver=True)
        await engine.start()
        try:
            assert engine.features.supports_sleep
            await engine.sleep(1)
            assert fake.state()["released"] == ["kv_cache"]
            held = asyncio.ensure_future(collect(engine.generate([request("z")])))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not held.done()
            await engine.wake_up()
            assert fake.state()["released"] == []
            assert (await held)[0].finish_reason is FinishReason.LENGTH
            await engine.sleep(2)
            assert fake.state()["released"] == ["kv_cache", "weights"]
            await engine.wake_up()
        finally:
            await engine.shutdown()

    run(body())


# ------------------------------------------------------------------ weights


def _always(token: int, version: int, *, bucket_bytes: int = 1024) -> list[WeightBucket]:
    """Weights under which the toy model puts (almost) all mass on ``token`` after any token."""
    weight = torch.zeros(VOCAB, VOCAB)
    weight[:, token] = 50.0
    return list(pack_buckets([("lm_head.weight", weight), ("lm_head.bias", torch.zeros(VOCAB))],
                             version=version, bucket_bytes=bucket_bytes))


async def _stream(buckets):
    for b in buckets:
        yield b


GLOO = {"weight_sync": {"backend": "gloo", "group_timeout_s": 60.0}}


def test_weight_update_round_trip_through_a_gloo_group(fake):
    """Buckets broadcast over gloo reach the fake's model: sampling changes, versions and weight_version follow."""

    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            buckets = _always(7, 1)
            assert len(buckets) == 2  # one request + broadcast per bucket
            await engine.update_weights(1, _stream(buckets))
            state = fake.state()
            assert engine.version == 1 and state["weight_version"] == "1" and state["flushes"] == 1
            assert state["counts"]["/update_weights_from_distributed"] == 2
            assert state["bodies"]["/update_weights_from_distributed"]["names"] == ["lm_head.bias"]
            assert torch.equal(torch.tensor(state["weights"]["lm_head.weight"])[:, 7], torch.full((VOCAB,), 50.0))
            (res,) = await collect(engine.generate([request("after", max_new_tokens=5)]))
            assert list(res.token_ids) == [7] * 5 and set(res.versions) == {1}
            assert max(res.logprobs) <= 0 and min(res.logprobs) > -1e-6
            assert res.metadata["sglang_weight_version"] == "1"
            await engine.update_weights(2, _stream(_always(3, 2, bucket_bytes=1 << 20)))  # the group is reused
            (res,) = await collect(engine.generate([request("again", max_new_tokens=5)]))
            assert list(res.token_ids) == [3] * 5 and set(res.versions) == {2}
            assert fake.state()["counts"]["/init_weights_update_group"] == 1
        finally:
            await engine.shutdown()

    run(body(), timeout=120)


def test_update_waits_for_in_flight_requests(fake):
    """Not paused: the update applies between requests, so a completion never mixes versions."""

    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("old", max_new_tokens=40)])))
            await until(lambda: "old" in fake.state()["running"], what="old to run")
            await engine.update_weights(1, _stream(_always(7, 1)))
            assert task.done()
            (res,) = await task
            assert set(res.versions) == {0} and res.finish_reason is FinishReason.LENGTH
        finally:
            await engine.shutdown()

    run(body(), timeout=120)


def test_a_request_held_by_the_paused_server_is_labelled_with_the_weights_it_ran_on(fake):
    """An abort can overtake its request: the paused server then holds it, and it runs after the update.

    Its answer's weight_version says which weights produced it, so its tokens carry the new version.
    """

    async def body():
        engine = make(fake.url, abort_retry_s=30.0, **GLOO)
        await engine.start()
        try:
            await engine.update_weights(1, _stream(_always(3, 1)))  # forms the group beforehand
            fake.faults(generate_delay_s=0.5)  # the request is still on its way when the pause lands
            task = asyncio.ensure_future(collect(engine.generate([request("late", max_new_tokens=5)])))
            await until(lambda: fake.state()["counts"].get("/generate", 0) == 1, what="late to be sent")
            await engine.pause(PauseMode.ABORT)
            fake.faults()
            await engine.update_weights(2, _stream(_always(7, 2)))
            await engine.resume()
            (res,) = await task
            return res
        finally:
            await engine.shutdown()

    res = run(body(), timeout=120)
    assert list(res.token_ids) == [7] * 5 and set(res.versions) == {2}
    assert res.metadata["sglang_weight_version"] == "2"


def test_a_corrupted_bucket_leaves_the_old_version(fake):
    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            good, last = _always(7, 1)
            bad = WeightBucket(last.version, last.index, last.metas, last.buffer.clone(), "0" * 32, last.last)
            with pytest.raises(WeightTransferError, match="corrupted"):
                await engine.update_weights(1, _stream([good, bad]))
            assert engine.version == 0
            state = fake.state()
            assert "/update_weights_from_distributed" not in state["counts"] and state["weight_version"] == "default"
            (res,) = await collect(engine.generate([request("still")]))
            assert res.finish_reason is FinishReason.LENGTH and set(res.versions) == {0}
        finally:
            await engine.shutdown()

    run(body(), timeout=60)


def test_a_refused_update_fails_the_engine(fake):
    """The server loads buckets as they come: a refused one leaves a mix, so the engine reports itself broken."""

    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            tensors = [("lm_head.bias", torch.full((VOCAB,), 2.0)), ("no.such.weight", torch.ones(3))]
            buckets = list(pack_buckets(tensors, version=1, bucket_bytes=64))
            assert len(buckets) == 2
            with pytest.raises(EngineError, match="failed after 1 of 2 buckets were sent.*mix of two versions"):
                await engine.update_weights(1, _stream(buckets))
            assert engine.version == 0 and not (await engine.health()).ok
            state = fake.state()
            assert state["weights"]["lm_head.bias"] == [2.0] * VOCAB and state["weight_version"] == "default"
            with pytest.raises(EngineError, match="mix of two versions"):
                await collect(engine.generate([request("no")]))
        finally:
            await engine.shutdown()

    run(body(), timeout=60)


def test_a_toy_grpo_run_trains_through_the_engine(fake, tmp_path):
    """The flow runtime end to end: toy trainer, this engine on the fake (the toy trainer's bigram table).

    Weight updates reach the server (pause(abort) -> update -> resume while requests run), every prompt is
    accounted for, and the staleness bound holds on the exact rows trained.
    """
    from pathlib import Path

    from asyncflow_core.config.loader import load_config, resolve
    from asyncflow_core.flow.runtime import run_flow

    fake.reset(model_kind="bigram", vocab_size=16, seed=0)  # the toy trainer's version-0 table
    example = Path(__file__).resolve().parents[3] / "examples" / "toy_grpo.yaml"
    options = f"{{url: '{fake.url}', weight_sync: {{backend: gloo, group_timeout_s: 60}}}}"
    config = resolve(load_config(example, ["rollout.name=sglang", f"rollout.options={options}",
                                           "trainer.total_steps=3"]))
    summary = run_flow(config, run_dir=tmp_path, write_png=False)
    assert summary["steps"] == 3 and summary["stop_reason"] == "done"
    ledger = summary["ledger"]
    assert ledger["trained"] + ledger["dropped"] + ledger["unfinished"] == ledger["admitted"]
    assert all(int(lag) <= 1 for lag in summary["staleness_histogram"])
    # the weight-sync task takes the newest staged version, so 3 steps give 1 to 3 updates
    updates = summary["counters"]["weight_updates"]
    assert updates >= 1
    state = fake.state()
    # (an update the stopping run cancelled still completes: the engine finishes it before shutting down)
    assert int(state["weight_version"]) >= 1 and state["counts"]["/update_weights_from_distributed"] >= updates


def test_tensor_mode_payload_is_sglangs_serialized_named_tensors():
    """Colocated mode sends SGLang's MultiprocessingSerializer format (GPU-only end to end; format checked here)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    from asyncflow_sglang.engine import serialize_named_tensors

    named = [("w", torch.arange(6.0).view(2, 3))]
    text = serialize_named_tensors(named)
    back = ForkingPickler.loads(io.BytesIO(base64.b64decode(text)).getvalue())
    assert back[0][0] == "w" and torch.equal(back[0][1], named[0][1])


# ------------------------------------------------------------------ config, launch, version


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "set exactly one of url"),
        ({"url": "http://127.0.0.1:1", "launch": {"model_path": "/m"}}, "set exactly one of url"),
        ({"url": "127.0.0.1:30000"}, "url must start with http://"),
        ({"url": "http://127.0.0.1:1", "keep_mode": "freeze"}, "keep_mode"),
        ({"url": "http://127.0.0.1:1", "min_server_version": "latest"}, "min_server_version must look like"),
        ({"launch": {"tp_size": 0}}, "tp_size"),
        ({"url": "http://127.0.0.1:1", "weight_sync": {"master_address": "10.0.0.5"}}, "allow_remote: true"),
        ({"url": "http://127.0.0.1:1", "weight_sync": {"device": "gpu"}}, "weight_sync.device"),
    ],
)
def test_bad_options_are_one_clear_config_error(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        get_plugin_manager().create("rollout_engine", "sglang", options)
    assert "\n" not in str(info.value)


def test_launch_without_a_model_is_a_config_error():
    engine = get_plugin_manager().create("rollout_engine", "sglang", {"launch": {"command": fake_command()}})
    with pytest.raises(ConfigError, match="launch.model_path or the run's model.path"):
        run(engine.start())


def test_launch_starts_waits_for_health_and_stops_the_server():
    async def body():
        engine = get_plugin_manager().create("rollout_engine", "sglang", {
            "launch": {"model_path": "toy", "command": fake_command(), "extra_args": ["--vocab-size", str(VOCAB)],
                       "startup_timeout_s": 60.0},
        })
        await engine.start()
        process = engine._server.process
        assert engine.url.startswith("http://127.0.0.1:")
        try:
            (res,) = await collect(engine.generate([request("l")]))
            assert res.finish_reason is FinishReason.LENGTH
        finally:
            await engine.shutdown()
        return process

    process = run(body())
    assert process.poll() is not None


def test_a_server_that_exits_while_starting_is_reported_with_its_log():
    engine = get_plugin_manager().create("rollout_engine", "sglang", {
        "launch": {"model_path": "toy", "command": [sys.executable, "-c", "import sys; print('no GPU found'); "
                                                                          "sys.exit(3)"]},
    })
    with pytest.raises(EngineError, match=r"(?s)exited with code 3.*no GPU found"):
        run(engine.start())


def test_an_older_server_is_refused(fake):
    engine = make(fake.url, min_server_version="9.0")
    with pytest.raises(EngineError, match="older than min_server_version 9.0"):
        run(engine.start())


def test_errors_are_asyncflow_errors():
    assert issubclass(EngineError, AsyncflowError)
