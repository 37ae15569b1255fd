"""Tests of the ``sglang`` rollout engine against the protocol fake (asyncflow_sglang.testing), not a real SGLang.

SGLang has no CPU build, so the server here is a child process speaking
SGLang's HTTP routes with a toy bigram model and, as read from SGLang 0.5.23's
source, the behaviour the engine depends on (see the fake's docstring). The
engine's code paths are the real ones: HTTP, error handling, abort races,
pause modes, and weight updates by torch.distributed broadcast (gloo on
127.0.0.1) into the fake, whose sampling reads the weights.

CI runs these through tests/adapters/test_sglang.py.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from typing import ClassVar

import pytest
import torch
from asyncflow_sglang.testing import fake_command, fake_server, toy_logits, toy_weights
from asyncflow_spec import RolloutEngineSpec
from asyncflow_spec.rollout import CONVENTION_CASES

from asyncflow_core.errors import AsyncflowError, ConfigError, EngineError, UnsupportedFeatureError, WeightTransferError
from asyncflow_core.interfaces import PauseMode
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import FinishReason, GenerationRequest, SamplingParams, WeightBucket
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_core.types.weights import pack_buckets

VOCAB = 32
SEED = 0


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def shared_fake():
    with fake_server("--random-seed", str(SEED), "--vocab-size", str(VOCAB), "--step-ms", "4",
                     "--enable-memory-saver", "--health-delay-s", "0.05", "--health-timeout-s", "0.5") as server:
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
    options: ClassVar[dict] = {"weight_sync": {"backend": "gloo", "group_timeout_s": 60.0}}

    vocab_size = VOCAB

    def weights(self):
        """The fake's model with other values: the spec's weight-update tests broadcast them over gloo."""
        return toy_weights(VOCAB, SEED + 1)

    def reference_logprobs(self, prompt, completion, sampling, *, weights):
        """The toy model scored independently of the fake (float64, asyncflow's sampling convention)."""
        table = {n: t.double() for n, t in (weights or toy_weights(VOCAB, SEED)).items()}
        previous = [prompt[-1], *completion[:-1]]
        logits = torch.stack([toy_logits(table, p) for p in previous])
        scored = sampling_logprobs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        return scored.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)

    @pytest.mark.parametrize("case", list(CONVENTION_CASES))
    def test_logprobs_follow_the_sampling_convention(self, make_backend, case):
        """A top_p < 1 case is refused with its reason: SGLang cuts top-p on the distribution before top-k and
        returns no log-prob renormalised after a top-p cut it can support (docs/adapters/sglang.md). Every other
        case is the suite's own test."""
        params = CONVENTION_CASES[case]
        if params.get("top_p", 1.0) >= 1.0:
            super().test_logprobs_follow_the_sampling_convention(make_backend, case)
            return

        async def body():
            engine = await self.started(make_backend)
            try:
                return [r async for r in engine.generate([self.request("top-p", **params)])]
            finally:
                await engine.shutdown()

        (res,) = self.run(body())
        assert res.finish_reason is FinishReason.ERROR and f"top_p={params['top_p']}" in res.error

    @pytest.fixture
    def make_backend(self, fake):
        pm = get_plugin_manager()

        def build(**overrides):
            return pm.create(self.kind, self.backend, {"url": fake.url, **self.options, **overrides})

        return build


class TestSGLangSpecRetract(TestSGLangSpec):
    """The suite's in-flight update test with keep_mode retract, the only mode that offers it (the rest of the suite
    runs above)."""

    options: ClassVar[dict] = {**TestSGLangSpec.options, "keep_mode": "retract"}


for _name in [n for n in dir(TestSGLangSpecRetract) if n.startswith("test_")]:
    if _name != "test_held_requests_continue_on_the_new_weights":
        setattr(TestSGLangSpecRetract, _name, None)


# ------------------------------------------------------------------ generate


def test_tokens_and_logprobs_match_the_served_model(fake):
    """Every token's log-prob is log_softmax(logits / T) of the toy model at that position (an independent oracle)."""
    weights = toy_weights(VOCAB, SEED)

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"o{i}", prompt=(i + 1, 5), max_new_tokens=12, temperature=0.7) for i in range(4)]
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
            reqs = [request(f"s{i}", max_new_tokens=400, stop_token_ids=tuple(range(0, VOCAB, 2)))
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


def test_top_p_sampling_is_refused_unless_asked_for(fake):
    """top_p < 1: SGLang cuts top-p before top-k and does not renormalise, so the request fails with the reason."""

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
    assert "return_sampling_mask" not in fake.state()["bodies"]["/generate"]
    by_id = {r.request_id: r for r in run(body(truncated_logprobs="server"))}
    assert by_id["t"].finish_reason is FinishReason.LENGTH


# ------------------------------------------------------------------ failures


def test_connection_refused_is_an_engine_error_naming_the_route():
    from asyncflow_sglang.launch import free_port

    engine = make(f"http://127.0.0.1:{free_port()}", connect_timeout_s=2.0)
    with pytest.raises(EngineError, match=r"GET http://127\.0\.0\.1:\d+/server_info.*ConnectError"):
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
            with pytest.raises(EngineError, match="/model_info failed too"):
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


# ------------------------------------------------------------------ connections (keep-alive, backlog, deadlines)


@pytest.mark.timeout(60)
def test_a_burst_of_new_connections_is_answered(fake):
    """64 calls at once open 64 connections together. The fake once listened with socketserver's backlog of 5:
    the kernel then reset some of those connections (``ReadError``: on this machine 17 to 30 of 64), which failed
    the engine and, in the toy GRPO run, hung the flow. SGLang's uvicorn listens with a backlog of 2048."""
    from asyncflow_sglang.client import SGLangClient

    async def body():
        client = SGLangClient(fake.url, connect_timeout_s=10.0, max_connections=64)
        try:
            return await asyncio.gather(*(
                client.post("/generate", {"rid": f"burst-{i}", "input_ids": [1],
                                          "sampling_params": {"max_new_tokens": 1}}, timeout_s=30.0)
                for i in range(64)))
        finally:
            await client.close()

    answers = run(body())
    assert [a["meta_info"]["completion_tokens"] for a in answers] == [1] * 64
    # what the fake's listen() gets: uvicorn's backlog (the burst above fails only when the kernel's queue overflows)
    from asyncflow_sglang.testing import LISTEN_BACKLOG, ProtocolFake, serve

    state = ProtocolFake(vocab_size=VOCAB)
    server = serve(state, "127.0.0.1", 0)
    try:
        assert server.request_queue_size == LISTEN_BACKLOG >= 2048
    finally:
        server.server_close()
        state.stop()


@pytest.mark.timeout(30)
def test_the_fake_closes_an_idle_connection_like_sglangs_uvicorn():
    """SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE (5 s); so does the fake
    (``--timeout-keep-alive``), and the client drops idle connections before that (``keepalive_s``)."""
    from asyncflow_sglang.testing import ProtocolFake, serve

    state = ProtocolFake(vocab_size=VOCAB)
    server = serve(state, "127.0.0.1", 0, keep_alive_s=0.2)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(b"GET /ready HTTP/1.1\r\nHost: fake\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            while sock.recv(4096):  # the rest of the answer, then the server's close (recv times out if never)
                pass
    finally:
        server.shutdown()
        server.server_close()
        state.stop()
    assert make("http://127.0.0.1:1").config.keepalive_s < 5.0  # below SGLang's keep-alive timeout


class _RawServer:
    """A loopback TCP server whose connections ``serve(conn, index)`` handles (tests of the HTTP client)."""

    def __init__(self, serve) -> None:
        self._serve = serve
        self.connections = 0
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            t = threading.Thread(target=self._handle, args=(conn, self.connections), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn, index: int) -> None:
        with conn:
            conn.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            self.requests.append(head.split(b"\r\n", 1)[0])
            self._serve(conn, index, self._stop)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self._sock.close()


def _ok(conn, body: bytes = b"{}") -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))


def _close_first_connection(conn, index, stop) -> None:
    """The first connection is closed as the request arrives (a keep-alive close racing a request), later ones
    answer."""
    if index > 1:
        _ok(conn)


def _call_raw(serve, method: str, route: str, timeout_s: float = 10.0) -> tuple[_RawServer, object]:
    """One SGLangClient call to a :class:`_RawServer` running ``serve``: the server, and what the call returned or
    raised."""
    from asyncflow_sglang.client import SGLangClient

    server = _RawServer(serve)

    async def body():
        client = SGLangClient(server.url, connect_timeout_s=2.0, max_connections=4)
        try:
            if method == "GET":
                return await client.get(route, timeout_s=timeout_s)
            return await client.post(route, {"input_ids": [1]}, timeout_s=timeout_s)
        finally:
            await client.close()

    try:
        return server, run(body())
    except Exception as exc:  # noqa: BLE001 - the test judges it
        return server, exc
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_an_idempotent_call_lost_to_a_closing_connection_is_sent_once_more():
    server, answer = _call_raw(_close_first_connection, "GET", "/model_info")
    assert answer == {}
    assert server.requests == [b"GET /model_info HTTP/1.1"] * 2


@pytest.mark.timeout(30)
def test_a_generate_lost_to_a_closing_connection_is_not_sent_twice():
    """/generate is not idempotent: a lost reply is an error naming the server and the call, never a resend."""
    from asyncflow_sglang.client import ServerUnreachableError

    server, answer = _call_raw(_close_first_connection, "POST", "/generate")
    assert isinstance(answer, ServerUnreachableError) and f"POST {server.url}/generate" in str(answer)
    assert server.requests == [b"POST /generate HTTP/1.1"]


def _trickle(conn, index, stop) -> None:
    """Answers a byte at a time, each well inside httpx's per-read timeout, and never finishes."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.02):
        try:
            conn.sendall(b" ")
        except OSError:
            return


@pytest.mark.timeout(30)
def test_a_call_has_one_deadline_however_the_server_trickles():
    """httpx's timeouts bound each read; a server that keeps sending a byte now and then would hold the call
    forever. ``timeout_s`` is the deadline of the whole call."""
    from asyncflow_sglang.client import ServerTimeoutError

    server, answer = _call_raw(_trickle, "POST", "/generate", timeout_s=0.5)
    assert isinstance(answer, ServerTimeoutError), answer
    assert f"did not answer POST {server.url}/generate within 0.5s" in str(answer)


# ------------------------------------------------------------------ abort and pause


def test_abort_returns_partial_tokens(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"a{i}", max_new_tokens=100_000) for i in range(2)]
            task = asyncio.ensure_future(collect(engine.generate(reqs)))
            await until(lambda: len(fake.state()["running"]) == 2, what="both to run")
            await until(lambda: min(fake.state()["progress"].values()) >= 3, what="a0 to have 3 tokens")
            assert await engine.abort(["a0", "missing"]) == ["a0"]
            await until(lambda: len(fake.state()["running"]) == 1, what="a0 to be aborted")
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
            await until(lambda: len(fake.state()["running"]) == 1, what="x to run")
            await engine.pause(PauseMode.ABORT)
            assert fake.state()["is_pause"] is True
            (res,) = await first
            assert res.finish_reason is FinishReason.ABORT
            sent_before = fake.state()["counts"]["/generate"]
            held = asyncio.ensure_future(collect(engine.generate([request("y")])))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not held.done() and fake.state()["counts"]["/generate"] == sent_before  # held here, not sent
            await engine.resume()
            (res,) = await held
            assert res.finish_reason is FinishReason.LENGTH and fake.state()["is_pause"] is False
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
            await until(lambda: sum(fake.state()["progress"].values()) >= 1, what="k to start")
            await engine.pause(PauseMode.KEEP)
            state = fake.state()
            assert state["paused"] == keep_mode
            await asyncio.sleep(0.1)  # long enough for ~25 toy steps, had the server not paused
            assert fake.state()["progress"] == state["progress"] and not task.done()
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
            await until(lambda: len(fake.state()["running"]) == 1, what="w to run")
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
            await until(lambda: len(fake.state()["running"]) == 1, what="old to run")
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


@pytest.mark.timeout(120)
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

    from asyncflow_sglang.protocol import serialize_named_tensors

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
        ({"url": "http://127.0.0.1:1", "min_server_version": "0.4.10"}, "min_server_version"),
        ({"launch": {"tp_size": 0}}, "tp_size"),
        ({"launch": {"dp_size": 2}}, "dp_size 2: SGLang's /init_weights_update_group asserts dp_size == 1"),
        ({"launch": {"dtype": "float32"}}, "dtype float32: SGLang's default attention backends"),
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


@pytest.mark.parametrize("version", ["0.5.19", "0.5.24", "0.6.0"])
def test_a_server_outside_the_supported_range_is_refused_with_the_install_line(version):
    with fake_server("--vocab-size", str(VOCAB), "--version", version) as server:
        engine = make(server.url)
        with pytest.raises(EngineError, match=r'outside the versions this adapter supports \(0\.5\.20 to 0\.5\.23\); '
                                              r'install one with pip install "sglang>=0\.5\.20,<0\.5\.24"'):
            run(engine.start())

        async def anyway():
            engine = make(server.url, allow_unsupported_version=True)
            await engine.start()
            await engine.shutdown()

        run(anyway())


def test_errors_are_asyncflow_errors():
    assert issubclass(EngineError, AsyncflowError)


# ------------------------------------------------------------------ SGLang 0.5.23 semantics (read from its source)
#
# Each test below pins a behaviour of SGLang that the protocol fake now models and that an earlier adapter got
# wrong; the docstring says how the earlier adapter failed against the stricter fake.


def test_rank0_meets_sglangs_rendezvous_convention():
    """The adapter's rank 0 and a rank joining like SGLang's init_custom_process_group (PrefixStore(group_name))
    form one gloo group and a broadcast arrives. With the adapter's old PrefixStore(init_method) prefix the two
    sides wait for different store keys and both time out.

    Rank 1 is the protocol fake's rendering of SGLang's convention (``sglang_join``), in a child process."""
    import subprocess
    import textwrap

    from asyncflow_sglang import weight_group

    store = weight_group.host_store("127.0.0.1", 2, 20.0)
    init_method = f"tcp://127.0.0.1:{store.port}"
    child = textwrap.dedent(f"""
        import torch
        from asyncflow_sglang.testing import sglang_join
        pg = sglang_join(backend="gloo", init_method={init_method!r}, world_size=2, rank=1,
                         group_name="g-conv", timeout_s=20.0)
        t = torch.empty(4)
        torch.distributed.broadcast(t, src=0, group=pg)
        print(t.tolist(), flush=True)
        torch.distributed.destroy_process_group(pg)
        import os
        os._exit(0)  # skip interpreter teardown: gloo's threads can abort it ("terminate called ...")
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group = weight_group.join(backend="gloo", init_method=init_method, rank=0, world_size=2, group_name="g-conv",
                                  timeout_s=20.0, store=store)
        weight_group.broadcast([torch.arange(4.0)], group)
        out, err = proc.communicate(timeout=30)
        weight_group.destroy(group)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "[0.0, 1.0, 2.0, 3.0]"


def test_updates_run_inside_a_session_on_0_5_23_and_without_on_0_5_20(fake):
    """SGLang >= 0.5.21 refuses /update_weights_from_distributed outside /begin_weight_update ... /end_weight_update
    (before posting any receive): the adapter opens and closes the session, once per update. Earlier the update was
    refused and its broadcast found no receiver. On 0.5.20 (no such routes) no session is asked for."""

    async def body(url):
        engine = make(url, **GLOO)
        await engine.start()
        try:
            await engine.update_weights(1, _stream(_always(7, 1)))
            (res,) = await collect(engine.generate([request("s", max_new_tokens=4)]))
            return res
        finally:
            await engine.shutdown()

    res = run(body(fake.url), timeout=120)
    state = fake.state()
    assert state["counts"]["/begin_weight_update"] == 1 and state["counts"]["/end_weight_update"] == 1
    assert state["session"] is False and state["counts"]["/update_weights_from_distributed"] == 2
    assert list(res.token_ids) == [7] * 4 and set(res.versions) == {1}
    with fake_server("--vocab-size", str(VOCAB), "--version", "0.5.20") as old:
        res = run(body(old.url), timeout=120)
        counts = old.state()["counts"]
    assert "/begin_weight_update" not in counts and list(res.token_ids) == [7] * 4


def test_a_session_begin_refused_leaves_the_engine_at_its_version(fake):
    """A refused /begin_weight_update loaded nothing: the update raises, the engine stays usable at its version."""

    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            await asyncio.to_thread(fake.call, "POST", "/begin_weight_update", {})  # someone else's open session
            with pytest.raises(EngineError, match="session is already open"):
                await engine.update_weights(1, _stream(_always(7, 1)))
            assert engine.version == 0 and (await engine.health()).ok
            assert "/update_weights_from_distributed" not in fake.state()["counts"]
        finally:
            await engine.shutdown()

    run(body(), timeout=120)


def test_wake_up_resumes_exactly_the_released_tags(fake):
    """sleep(1) releases kv_cache only; wake_up must resume exactly that. SGLang resumes every tag named (null names
    them all) and a tag never released raises in its scheduler, taking the server down: the earlier adapter sent
    ``{"tags": null}`` and killed the server."""

    async def body():
        engine = make(fake.url, memory_saver=True)
        await engine.start()
        try:
            await engine.sleep(1)
            await engine.wake_up()
            assert fake.state()["bodies"]["/resume_memory_occupation"] == {"tags": ["kv_cache"]}
            await engine.sleep(1)
            await engine.sleep(2)  # only weights are left to release
            assert fake.state()["bodies"]["/release_memory_occupation"] == {"tags": ["weights"]}
            await engine.wake_up()
            assert fake.state()["bodies"]["/resume_memory_occupation"] == {"tags": ["kv_cache", "weights"]}
            (res,) = await collect(engine.generate([request("w")]))
            assert res.finish_reason is FinishReason.LENGTH and fake.state()["released"] == []
        finally:
            await engine.shutdown()

    run(body())


def test_the_fake_dies_on_resuming_a_tag_never_released_and_on_releasing_a_busy_server():
    """The fake is as strict as SGLang's scheduler: both raise there (KeyError / AssertionError), and an exception in
    SGLang's scheduler SIGQUITs the whole server."""
    with fake_server("--vocab-size", str(VOCAB), "--enable-memory-saver") as server:
        server.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        with pytest.raises(OSError):  # the connection drops: no answer
            server.call("POST", "/resume_memory_occupation", {"tags": None})
        assert server.died()
    with fake_server("--vocab-size", str(VOCAB), "--enable-memory-saver", "--step-ms", "20") as server:

        async def busy():
            engine = make(server.url)
            await engine.start()
            task = asyncio.ensure_future(collect(engine.generate([request("b", max_new_tokens=100_000)])))
            await until(lambda: len(server.state()["running"]) == 1, what="b to run")
            with pytest.raises(OSError):
                await asyncio.to_thread(server.call, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
            with pytest.raises(EngineError):
                await task
            await engine.shutdown()

        run(busy())
        assert server.died()


def test_an_abort_the_paused_server_could_not_deliver_is_swept_up_after_resume(fake):
    """A request held by SGLang's pause gate is known to it but not to its scheduler: its one abort is forwarded
    and lost, and SGLang ignores every later abort of that rid. The engine then sends abort_all once every request
    of its own is aborted, so the held request ends with ABORT soon after resume. (The earlier adapter re-sent
    aborts by rid, which the fake now ignores as SGLang does: the request ran to its 100k tokens.)"""

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            fake.faults(generate_delay_s=0.3)  # still on its way when the pause lands
            task = asyncio.ensure_future(collect(engine.generate([request("held", max_new_tokens=100_000)])))
            await until(lambda: fake.state()["counts"].get("/generate", 0) == 1, what="held to be sent")
            await engine.pause(PauseMode.ABORT)
            await until(lambda: len(fake.state()["known"]) == 1, what="held to reach the paused server")
            await engine.resume()
            (res,) = await task
            return res
        finally:
            await engine.shutdown()

    res = run(body())
    assert res.finish_reason is FinishReason.ABORT and len(res.token_ids) < 100_000


def test_abort_reaches_only_the_named_request_though_sglang_matches_rid_prefixes(fake):
    """SGLang aborts every request whose rid starts with the one named: ``p1`` would abort ``p10`` too. The engine
    sends its own fixed-length rids, so aborting ``p1`` leaves ``p10`` running."""

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            p1 = asyncio.ensure_future(collect(engine.generate([request("p1", max_new_tokens=100_000)])))
            p10 = asyncio.ensure_future(collect(engine.generate([request("p10", max_new_tokens=100_000)])))
            await until(lambda: len(fake.state()["running"]) == 2, what="both to run")
            assert await engine.abort(["p1"]) == ["p1"]
            (res,) = await p1
            assert res.finish_reason is FinishReason.ABORT
            assert len(fake.state()["running"]) == 1 and not p10.done()
            await engine.abort(None)
            (res,) = await p10
            assert res.finish_reason is FinishReason.ABORT
        finally:
            await engine.shutdown()

    run(body())


def test_health_is_a_cheap_route_that_holds_while_paused(fake):
    """SGLang's /health generates a token (1 s at least) and answers 503 after 20 s while paused: the engine asks
    /model_info instead. (The earlier adapter's health() reported a paused server as down: the fake's /health is
    503 after 0.5 s here.)"""

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("k", max_new_tokens=60)])))
            await until(lambda: len(fake.state()["running"]) == 1, what="k to run")
            await engine.pause(PauseMode.KEEP)
            health = await engine.health()
            assert health.ok and health.detail == "paused"
            await engine.resume()
            await task
        finally:
            await engine.shutdown()

    run(body())
    assert "/health" not in fake.state()["counts"]
    fake.call("POST", "/pause_generation", {"mode": "in_place"})
    with pytest.raises(urllib_error().HTTPError, match="503"):
        fake.call("GET", "/health")
    fake.call("POST", "/continue_generation", {})


def urllib_error():
    import urllib.error

    return urllib.error


def test_flush_waits_out_a_health_probe_from_elsewhere(fake):
    """A /health probe is a request while it lasts, so SGLang's /flush_cache answers 400 meanwhile; the update's
    flush tries again instead of failing the engine (as it did before)."""
    import threading

    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        try:
            await engine.update_weights(1, _stream(_always(3, 1)))  # group formed, nothing else in the way
            fake.faults(health_delay_s=1.5)
            probe = threading.Thread(target=fake.call, args=("GET", "/health"))
            probe.start()
            await until(lambda: fake.state()["probes"] == 1, what="the probe to run")
            await engine.update_weights(2, _stream(_always(7, 2)))
            await asyncio.to_thread(probe.join)
            assert engine.version == 2 and (await engine.health()).ok
        finally:
            await engine.shutdown()

    run(body(), timeout=120)


def test_seeds_are_refused_unless_the_server_is_deterministic(fake):
    """SGLang ignores sampling_seed without --enable-deterministic-inference: such a request fails with the reason
    (earlier it was sent and silently sampled unseeded). With the flag, one seed gives one completion."""

    async def body(url):
        engine = make(url)
        await engine.start()
        try:
            reqs = [request(f"d{i}", max_new_tokens=12, seed=5) for i in range(2)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body(fake.url))
    assert all(r.finish_reason is FinishReason.ERROR and "--enable-deterministic-inference" in r.error
               for r in results)
    with fake_server("--vocab-size", str(VOCAB), "--enable-deterministic-inference") as server:
        first, second = run(body(server.url))
        assert server.state()["bodies"]["/generate"]["sampling_params"]["sampling_seed"] == 5
    assert first.finish_reason is FinishReason.LENGTH and first.token_ids == second.token_ids


def test_temperatures_sglang_turns_greedy_are_refused(fake):
    """Below 1e-6 SGLang samples greedily and reports unscaled log-probs: refused with the reason."""

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            return await collect(engine.generate([request("g", temperature=1e-7)]))
        finally:
            await engine.shutdown()

    (res,) = run(body())
    assert res.finish_reason is FinishReason.ERROR and "at least 1e-6" in res.error
    assert "/generate" not in fake.state()["counts"]


def test_top_k_log_probs_are_renormalised_through_the_sampling_mask(fake):
    """top-k requests ask SGLang for return_sampling_mask and return its renormalised selected log-probs: equal to
    asyncflow's convention (an independent score of the toy model, top-k applied, renormalised)."""
    weights = toy_weights(VOCAB, SEED)

    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            reqs = [request(f"k{i}", prompt=(i + 1, 4), max_new_tokens=10, temperature=0.8, top_k=4) for i in range(3)]
            return await collect(engine.generate(reqs))
        finally:
            await engine.shutdown()

    results = run(body())
    assert fake.state()["bodies"]["/generate"]["return_sampling_mask"] is True
    for res in results:
        assert res.finish_reason is FinishReason.LENGTH
        previous = [res.prompt_token_ids[-1], *res.token_ids[:-1]]
        logits = torch.stack([toy_logits(weights, p) for p in previous])
        expected = sampling_logprobs(logits, 0.8, top_k=4).gather(1, torch.tensor(res.token_ids).unsqueeze(1))
        # float32 arithmetic on both sides: a few ulps of log-probs of size ~1
        torch.testing.assert_close(torch.tensor(res.logprobs), expected.squeeze(1), atol=1e-5, rtol=1e-5)


def test_a_top_k_above_the_servers_sampling_mask_limit_is_refused(fake):
    async def body():
        engine = make(fake.url)
        await engine.start()
        try:
            return await collect(engine.generate([request("big", top_k=5000)]))
        finally:
            await engine.shutdown()

    (res,) = run(body())
    assert res.finish_reason is FinishReason.ERROR and "--sampling-mask-max-tokens (4096)" in res.error


def test_an_update_while_retract_holds_requests_labels_each_token_by_the_weights_that_sampled_it(fake):
    """keep_mode retract: requests held by pause(keep) continue on the new weights after resume, and the answer's
    weight_versions spans give each token its version: the old one before the update, the new one after."""

    async def body():
        engine = make(fake.url, keep_mode="retract", **GLOO)
        await engine.start()
        assert engine.features.supports_inflight_weight_update
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("r", max_new_tokens=80)])))
            await until(lambda: next(iter(fake.state()["progress"].values()), 0) >= 3, what="r to have 3 tokens")
            await engine.pause(PauseMode.KEEP)
            await engine.update_weights(1, _stream(_always(7, 1)))
            await engine.resume()
            (res,) = await task
            return res
        finally:
            await engine.shutdown()

    res = run(body(), timeout=120)
    versions = list(res.versions)
    boundary = versions.index(1)
    assert boundary >= 3 and set(versions[:boundary]) == {0} and set(versions[boundary:]) == {1}
    assert set(res.token_ids[boundary:]) == {7}


def test_an_update_while_in_place_holds_requests_is_refused(fake):
    async def body():
        engine = make(fake.url, **GLOO)
        await engine.start()
        assert not engine.features.supports_inflight_weight_update
        try:
            task = asyncio.ensure_future(collect(engine.generate([request("i", max_new_tokens=200)])))
            await until(lambda: len(fake.state()["running"]) == 1, what="i to run")
            await engine.pause(PauseMode.KEEP)
            with pytest.raises(UnsupportedFeatureError, match="keep_mode: retract"):
                await engine.update_weights(1, _stream(_always(7, 1)))
            await engine.resume()
            await task
        finally:
            await engine.shutdown()

    run(body(), timeout=60)


def test_a_data_parallel_server_is_refused_at_start():
    """SGLang asserts dp_size == 1 for its weight-update group (the fake answers its group routes 500)."""
    with fake_server("--vocab-size", str(VOCAB), "--dp-size", "2") as server:
        with pytest.raises(ConfigError, match="runs dp_size 2"):
            run(make(server.url).start())
        with pytest.raises(urllib_error().HTTPError, match="500"):
            server.call("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                               "rank_offset": 1, "world_size": 2})


def test_admin_routes_take_the_admin_key():
    """A server started with --api-key and --admin-api-key takes only the admin key on its admin routes (abort,
    pause, weights, memory, flush) and the api key on the rest."""
    with fake_server("--vocab-size", str(VOCAB), "--api-key", "user", "--admin-api-key", "admin") as server:

        async def body(**keys):
            engine = make(server.url, **keys)
            await engine.start()
            try:
                (res,) = await collect(engine.generate([request("a")]))
                assert res.finish_reason is FinishReason.LENGTH
                await engine.pause(PauseMode.KEEP)
                await engine.resume()
            finally:
                await engine.shutdown()

        run(body(api_key="user", admin_api_key="admin"))
        with pytest.raises(EngineError, match="401"):
            run(body(api_key="user"))


def test_launch_passes_the_deterministic_and_admin_flags():
    from asyncflow_sglang.config import SGLangRolloutConfig
    from asyncflow_sglang.launch import launch_arguments

    config = SGLangRolloutConfig(launch={"model_path": "/m", "deterministic_inference": True},
                                 admin_api_key="admin")
    args = launch_arguments(config, 30000)
    assert "--enable-deterministic-inference" in args and args[args.index("--admin-api-key") + 1] == "admin"


def test_token_versions_follow_the_spans():
    from asyncflow_sglang.protocol import span_versions

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert span_versions(spans, 5) == ["3", "3", "4", "4", "4"]
    assert span_versions(spans, 4) is None  # they must cover the answer's tokens exactly
    assert span_versions([{"version": "3", "start": 1, "end": 2}], 1) is None
    assert span_versions(None, 3) is None


def test_tensor_mode_names_the_gpu_by_uuid_where_torch_writes_its_index():
    """SGLang's senders replace reduce_tensor's device index (argument 6) by the GPU's UUID; its receivers map the
    UUID back to their own index, so another CUDA_VISIBLE_DEVICES cannot point at the wrong GPU."""
    from asyncflow_sglang.protocol import CUDA_DEVICE_ARG, with_device_uuid

    args = ("cls", "size", "stride", 0, "storage_cls", "dtype", 1, b"handle", 8, 0, False)
    out = with_device_uuid(args, lambda index: f"GPU-uuid-{index}")
    assert CUDA_DEVICE_ARG == 6 and out[6] == "GPU-uuid-1" and out[:6] == args[:6] and out[7:] == args[7:]
    assert with_device_uuid(out, lambda index: "again") == out  # already a UUID


def test_the_supported_range_is_the_same_in_the_metadata_and_the_code():
    """pyproject's `server` extra, the install line in messages and the range start() checks say one thing."""
    import tomllib
    from pathlib import Path

    from asyncflow_sglang.config import SGLANG_INSTALL, SUPPORTED_SGLANG, show_version

    low, high = SUPPORTED_SGLANG
    pin = f"sglang>={show_version(low)},<{high[0]}.{high[1]}.{high[2] + 1}"
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["server"] == [pin]
    assert SGLANG_INSTALL == f'pip install "{pin}"'


def test_the_models_eos_ends_a_completion_only_when_the_request_lists_it():
    """SGLang ends a completion at the model's EOS as well as at the request's stop ids (ignore_eos turns off
    both); asyncflow ends one only at the request's stop ids, so the engine goes on after an unlisted EOS."""
    eos = 5
    weight = torch.zeros(VOCAB, VOCAB)
    weight[:, eos] = 50.0  # every token is the EOS

    async def body(url, **sampling):
        engine = make(url, **GLOO)
        await engine.start()
        try:
            buckets = list(pack_buckets([("lm_head.weight", weight), ("lm_head.bias", torch.zeros(VOCAB))],
                                        version=1, bucket_bytes=1 << 20))
            await engine.update_weights(1, _stream(buckets))
            (res,) = await collect(engine.generate([request("e", max_new_tokens=4, **sampling)]))
            return res
        finally:
            await engine.shutdown()

    with fake_server("--vocab-size", str(VOCAB), "--eos-token-id", str(eos)) as server:
        res = run(body(server.url), timeout=120)
        assert res.finish_reason is FinishReason.LENGTH and list(res.token_ids) == [eos] * 4, res
        assert len(res.logprobs) == len(res.versions) == 4 and set(res.versions) == {1}
        assert server.state()["counts"]["/generate"] == 4  # one request per EOS the model sampled
        res = run(body(server.url, stop_token_ids=(eos,)), timeout=120)
        assert res.finish_reason is FinishReason.STOP and list(res.token_ids) == [eos]
