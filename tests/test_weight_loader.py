"""``WeightLoader``: a weight version loaded by view (the model's tensors become views of the received buckets).

The oracle is independent of the loader: each version's tensors are kept as
clones when they are made, and the model's tensors must equal the clones
of the version it loaded, whatever is exported, sent or dropped after. Views
are observed through data pointers (a model tensor inside a bucket's buffer).
The tests that a sender never rewrites a viewed version also run once with
the rule deliberately broken, to show that the observation catches a rewrite.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import EngineError, WeightTransferError
from asyncflow_core.types import WeightBucket, pack_buckets
from asyncflow_core.types import weights as W
from asyncflow_core.types.weights import ExportArena, LoadInterrupted, WeightLoader, verify_buckets
from asyncflow_plugins.hf.model import build_causal_lm
from asyncflow_plugins.transports import InProcessTransport
from asyncflow_plugins.weight_transports.config import ShmTransportConfig
from asyncflow_plugins.weight_transports.shm import ShmWeightTransport

DEADLINE_S = 30.0
TIED = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 48,
        "max_position_embeddings": 64, "tie_word_embeddings": True}


def net(seed: int) -> torch.nn.Module:
    return build_causal_lm(ModelConfig(hf_config=TIED), seed=seed)


def exported(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's export: ``state_dict`` order, tied tensors under their first name only."""
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t.detach()))
    return out


def version_tensors(v: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(v)
    return [("a", torch.randn(64, 16, generator=gen)), ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
            ("c", torch.randn(16, 33, generator=gen))]


def model_of(v: int = 0) -> dict[str, torch.Tensor]:
    return {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in version_tensors(v)}


def pack(v: int, allocate=None) -> list[WeightBucket]:
    return list(pack_buckets(version_tensors(v), version=v, bucket_bytes=2048, allocate=allocate))


def pairs(buckets: list[WeightBucket]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for b in buckets for n, t in b.tensors()]


def inside(t: torch.Tensor, buckets: list[WeightBucket]) -> bool:
    return any(b.buffer.data_ptr() <= t.data_ptr() < b.buffer.data_ptr() + b.nbytes for b in buckets)


def assert_holds(model: dict[str, torch.Tensor], v: int) -> None:
    for name, expected in version_tensors(v):
        assert torch.equal(model[name], expected), f"{name} no longer holds version {v}'s bytes"


async def aiter_of(items):
    for item in items:
        yield item


# ---------------------------------------------------------------- the loader alone


def test_a_view_load_makes_the_model_read_the_buckets_and_keeps_tied_weights_tied() -> None:
    engine, trainer = net(0), net(1)
    named = dict(engine.state_dict(keep_vars=True))
    embed = engine.model.embed_tokens.weight
    assert engine.lm_head.weight is embed  # tied: one object under two names
    buckets = list(pack_buckets(exported(trainer), version=1, bucket_bytes=4096))
    loader = WeightLoader(named)
    loader.load(pairs(buckets))
    assert all(inside(t, buckets) for t in named.values())  # no copy: every tensor reads its bucket
    assert engine.lm_head.weight is embed and engine.lm_head.weight.data_ptr() == embed.data_ptr()
    assert loader.viewing == len({id(t) for t in named.values()})
    assert loader.stats()["copied_bytes"] == 0
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, trainer(input_ids=ids).logits, rtol=0, atol=0)


def test_copy_mode_and_a_device_or_layout_mismatch_copy_into_the_model_own_memory() -> None:
    model = model_of()
    before = {n: t.data_ptr() for n, t in model.items()}
    buckets = pack(1)
    WeightLoader(model, views=False).load(pairs(buckets))
    assert_holds(model, 1)
    assert {n: t.data_ptr() for n, t in model.items()} == before

    model = model_of()
    own_a = model["a"].data_ptr()
    strided = [(n, torch.empty(t.shape[::-1], dtype=t.dtype).t().copy_(t)) if t.dim() == 2 else (n, t)
               for n, t in version_tensors(1)]
    assert not strided[0][1].is_contiguous()
    loader = WeightLoader(model)
    loader.load(strided)
    assert_holds(model, 1)
    assert model["a"].data_ptr() == own_a and loader.viewing == 1  # only "b" (contiguous) is viewed


def test_a_tensor_something_else_aliases_is_copied_into_so_the_alias_sees_the_new_version() -> None:
    model = model_of()
    alias = model["a"][:4]  # e.g. a module's cached slice of its weight
    packed_model = torch.zeros(64 * 16 + 16 * 33)
    model["c"] = torch.nn.Parameter(packed_model[:16 * 33].view(16, 33), requires_grad=False)
    model["c2"] = torch.nn.Parameter(packed_model[8:8 + 16 * 33].view(16, 33), requires_grad=False)  # overlaps "c"
    buckets = pack(1)
    loader = WeightLoader(model)
    loader.load(pairs(buckets))
    assert_holds(model, 1)
    assert torch.equal(alias, version_tensors(1)[0][1][:4])  # copied in place, so the alias follows
    assert not inside(model["a"], buckets) and not inside(model["c"], buckets)
    assert inside(model["b"], buckets) and loader.viewing == 1


def test_a_viewed_buffer_is_never_written_a_later_copy_goes_to_fresh_memory() -> None:
    model = model_of()
    first = pack(1)
    saved = [b.buffer.clone() for b in first]
    loader = WeightLoader(model)
    loader.load(pairs(first))
    assert all(inside(t, first) for t in model.values())
    # version 2 arrives in a form that cannot be viewed (non-contiguous): it must not be copied into version 1's buffers
    second = [(n, torch.empty(t.shape[::-1], dtype=t.dtype).t().copy_(t) if t.dim() == 2 else t.clone())
              for n, t in version_tensors(2)]
    loader.load([(n, t) for n, t in second if n != "b"])
    assert all(torch.equal(b.buffer, s) for b, s in zip(first, saved, strict=True)), "a received buffer was written"
    assert not inside(model["a"], first) and not inside(model["c"], first) and inside(model["b"], first)
    assert torch.equal(model["a"], version_tensors(2)[0][1]) and loader.viewing == 1
    verify_buckets([WeightBucket(b.version, b.index, b.metas, b.buffer, b.checksum, b.last) for b in first])


def test_a_copy_that_fails_half_way_says_the_model_is_mixed(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of()
    calls = []

    def failing(pairs_):
        calls.append(len(pairs_))
        if pairs_:
            raise RuntimeError("device lost")

    monkeypatch.setattr(W, "copy_tensors", failing)
    with pytest.raises(LoadInterrupted, match="half way"):
        WeightLoader(model, views=False).load(pairs(pack(1)))
    assert calls == [0, 3]


# ---------------------------------------------------------------- senders never rewrite a viewed version


def with_transport(make, body):
    """``await body(transport, model, loader)`` with a new transport and model, the transport closed after."""

    async def main():
        transport, model = make(), model_of()
        try:
            return await body(transport, model, WeightLoader(model))
        finally:
            await transport.close()

    return asyncio.run(main())


async def send_and_load(transport, loader: WeightLoader | None, v: int, allocate=None) -> None:
    """Send version ``v`` (packed with ``allocate``); with a loader, receive it and load it by view."""
    await transport.send(aiter_of(pack(v, allocate)), deadline_s=DEADLINE_S)
    if loader is not None:
        loader.load(pairs([b async for b in transport.receive(min_version=v, deadline_s=DEADLINE_S)]))


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    return all(torch.equal(model[n], t) for n, t in version_tensors(v))


@pytest.mark.parametrize("rule", ["kept", "broken"])
def test_an_arena_never_rewrites_the_version_a_model_views(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """inprocess: the model views version 1, three more are exported through the arena; version 1 stays intact.

    ``broken``: an arena that ignores who holds a slot (its use count check off) rewrites the viewed version,
    which this test sees: the check is what keeps the model's weights.
    """
    if rule == "broken":
        monkeypatch.setattr(W._Slot, "free", lambda self: self.claim is None or self.claim() is None)
    arena = ExportArena()

    async def body(transport, model, loader) -> bool:
        await send_and_load(transport, loader, 1, arena.allocator())
        kept = arena._slots[0].buffers
        assert all(any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in kept) for t in model.values())
        for v in (2, 3, 4):  # the engine skips these: it keeps viewing version 1
            await send_and_load(transport, None, v, arena.allocator())
        return holds(model, 1)

    assert with_transport(InProcessTransport, body) is (rule == "kept")


def test_an_engine_loading_every_version_keeps_the_arena_double_buffered() -> None:
    arena = ExportArena()

    async def body(transport, model, loader) -> None:
        for v in range(1, 7):
            await send_and_load(transport, loader, v, arena.allocator())
            assert holds(model, v)
        stats = arena.stats()
        assert stats["slots"] == 2 and stats["fresh_versions"] == 0 and stats["reused_bytes"] > 0
        assert loader.stats()["copied_bytes"] == 0 and loader.viewing == len(model)

    with_transport(InProcessTransport, body)


@pytest.mark.parametrize("rule", ["kept", "broken"])
def test_shm_a_version_a_model_views_is_never_rewritten(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """shm: the model views version 2's mapping and skips versions 3 and 4; version 2 stays intact.

    ``broken``: a sender that rewrites a slot whatever maps it (its lock check forced) overwrites the model's
    weights in place, which this test sees.
    """
    if rule == "broken":
        from asyncflow_core.kept_segments import KeptSegment

        monkeypatch.setattr(ShmWeightTransport, "_lock_slot", lambda self, segment: True)
        monkeypatch.setattr(KeptSegment, "held_outside", lambda self: False)

    async def body(sender, model, loader) -> bool:
        await send_and_load(sender, loader, 1)  # the first version sizes the segments: copied in
        await send_and_load(sender, loader, 2, sender.allocator())  # slot b, viewed from now on
        await send_and_load(sender, None, 3, sender.allocator())  # slot a
        await send_and_load(sender, None, 4, sender.allocator())  # wants slot b, which the model maps
        if rule == "kept":
            assert sender.stats()["slots_held"] == 1
        return holds(model, 2)

    assert with_transport(lambda: ShmWeightTransport(ShmTransportConfig()), body) is (rule == "kept")


def test_shm_a_model_loading_every_version_reuses_both_slots_and_its_writes_stay_private() -> None:
    async def body(sender, model, loader) -> None:
        segments = []
        for v in range(1, 6):
            await send_and_load(sender, loader, v, sender.allocator() if v > 1 else None)
            segments.append(sender._staged.segment)
            assert holds(model, v)
        assert sender.stats()["slots_held"] == 0
        assert segments == [segments[0], segments[1]] * 2 + [segments[0]] and segments[0] != segments[1]
        # a write into the model's weights changes its private copy-on-write pages, never the segment
        with torch.no_grad():
            model["a"].add_(1.0)
        again = [b async for b in sender.receive(min_version=5, deadline_s=DEADLINE_S)]  # hashed afresh
        assert torch.equal(dict(pairs(again))["a"], version_tensors(5)[0][1])

    with_transport(lambda: ShmWeightTransport(ShmTransportConfig()), body)


# ---------------------------------------------------------------- the torch engine


def engine_of(**options):
    from asyncflow_core.plugins import get_plugin_manager

    return get_plugin_manager().create("rollout_engine", "torch", {
        "model": {"hf_config": TIED}, "device": "cpu", "eos_token_ids": [], "torch_threads": 1, **options})


def test_the_torch_engine_views_an_update_and_samples_from_it() -> None:
    from asyncflow_core.types import GenerationRequest, SamplingParams
    from test_torch_rollout import assert_teacher_forced

    trainer = net(1)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.9)

    arena = ExportArena()

    async def body():
        engine = engine_of()
        await engine.start()
        try:
            buckets = list(pack_buckets(exported(trainer), version=1, bucket_bytes=4096, allocate=arena.allocator()))
            await engine.update_weights(1, aiter_of(buckets))
            assert all(inside(t, buckets) for t in engine._params.values())
            assert engine._net.lm_head.weight is engine._net.model.embed_tokens.weight
            del buckets
            assert not arena._slots[0].free()  # the engine holds the version it loaded
            return [r async for r in engine.generate([GenerationRequest("r", (1, 2, 3), sampling)])]
        finally:
            await engine.shutdown()
            assert arena._slots[0].free()  # and lets it go when it shuts down

    (res,) = asyncio.run(body())
    assert set(res.versions) == {1}
    assert_teacher_forced(trainer, res, sampling)


def test_the_torch_engine_copy_mode_and_a_load_failing_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = net(1)

    async def body():
        engine = engine_of(weight_load="copy")
        await engine.start()
        try:
            buckets = list(pack_buckets(exported(trainer), version=1, bucket_bytes=4096))
            await engine.update_weights(1, aiter_of(buckets))
            assert not any(inside(t, buckets) for t in engine._params.values())
            assert all(torch.equal(engine._params[n], t) for n, t in exported(trainer))

            def failing(pairs_):
                if pairs_:
                    raise RuntimeError("device lost")

            monkeypatch.setattr(W, "copy_tensors", failing)
            with pytest.raises(WeightTransferError, match="half way"):
                await engine.update_weights(2, aiter_of(pack_buckets(exported(net(2)), version=2,
                                                                     bucket_bytes=4096)))
            assert engine.version == 1 and not (await engine.health()).ok
            with pytest.raises(EngineError, match="restart the engine"):
                [r async for r in engine.generate([])]
        finally:
            await engine.shutdown()

    asyncio.run(body())
