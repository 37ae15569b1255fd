"""Weight packing, span copies and the in-place ``shm`` export with CUDA tensors (skipped without CUDA).

The host fast paths (``pack_buckets`` filling and hashing spans on the digest
threads, ``copy_tensors``, ``ShmWeightTransport.allocator``) must step aside
for device tensors: these pin down that a CUDA export packs, hashes and loads
the same bytes as a CPU one. Written by reading torch 2.13's ``copy_`` /
``Tensor.numpy`` contracts (a CUDA tensor has no numpy view), never run here.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncflow_core.types import pack_buckets
from asyncflow_core.types.weights import copy_tensors


def _items(device: str) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    cpu = [("a", torch.randn(3_000_001, generator=gen)), ("b", torch.randn(33, generator=gen).to(torch.bfloat16)),
           ("c", torch.randint(0, 7, (1001,), generator=gen))]
    return [(n, t.to(device)) for n, t in cpu]


@pytest.mark.gpu
def test_a_cuda_export_packs_the_same_bytes_and_checksums_as_a_cpu_one():
    on_gpu = list(pack_buckets(_items("cuda"), version=1, bucket_bytes=8 << 20))
    on_cpu = list(pack_buckets(_items("cpu"), version=1, bucket_bytes=8 << 20))
    assert all(b.buffer.is_cuda for b in on_gpu)
    assert [b.checksum for b in on_gpu] == [b.checksum for b in on_cpu]
    for g, c in zip(on_gpu, on_cpu, strict=True):
        assert g.verified and torch.equal(g.buffer.cpu(), c.buffer)


@pytest.mark.gpu
def test_copy_tensors_loads_host_buckets_into_cuda_parameters_and_back():
    src = [t for _, t in _items("cpu")]
    dst = [torch.zeros_like(t, device="cuda") for t in src]
    copy_tensors(list(zip(dst, src, strict=True)))
    torch.cuda.synchronize()
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dst, src, strict=True))
    back = [torch.zeros_like(t) for t in src]
    copy_tensors(list(zip(back, dst, strict=True)))
    assert all(torch.equal(b, s) for b, s in zip(back, src, strict=True))


@pytest.mark.gpu
def test_shm_copies_cuda_buckets_in_and_delivers_them_on_the_host():
    from asyncflow_plugins.weight_transports.config import ShmTransportConfig
    from asyncflow_plugins.weight_transports.shm import ShmWeightTransport

    async def feed(xs):
        for x in xs:
            yield x

    async def main() -> None:
        sender = ShmWeightTransport(ShmTransportConfig())
        try:
            for v in (1, 2):
                sent = list(pack_buckets(_items("cuda"), version=v, bucket_bytes=8 << 20,
                                         allocate=sender.allocator(fallback=lambda n: torch.empty(
                                             n, dtype=torch.uint8, device="cuda"))))
                await sender.send(feed(sent), deadline_s=60)
                got = [b async for b in sender.receive(min_version=v, deadline_s=60)]
                assert [b.checksum for b in got] == [b.checksum for b in sent]
                assert all(not b.buffer.is_cuda for b in got)
        finally:
            await sender.close()

    asyncio.run(main())


@pytest.mark.gpu
def test_a_rank_ships_cuda_tensors_into_kept_host_segments():
    from asyncflow_core.launchers.rank_driver import from_shared_memory
    from asyncflow_core.launchers.rank_worker import RankWorkerBase

    worker = RankWorkerBase(0, 1, None)
    try:
        for v in (1, 2, 3):
            described = worker.ship_buckets(_items("cuda"), {"version": v, "bucket_bytes": 8 << 20, "index": 0})
            cpu = list(pack_buckets(_items("cpu"), version=v, bucket_bytes=8 << 20))
            assert [d["checksum"] for d in described] == [b.checksum for b in cpu]
            for d, b in zip(described, cpu, strict=True):
                assert torch.equal(from_shared_memory(d["shm"], d["nbytes"], kept=d["kept"]), b.buffer)
    finally:
        worker.close()


@pytest.mark.gpu
def test_a_cuda_model_copies_host_buckets_and_views_cuda_ones():
    """Loading by view needs the same device: host buckets are copied into a CUDA model (a view would move the
    model's tensor to the host, as ``tensor.data = host`` allows), CUDA buckets are viewed."""
    from asyncflow_core.types.weights import WeightLoader

    model = {n: torch.nn.Parameter(torch.zeros_like(t, device="cuda"), requires_grad=False) for n, t in _items("cpu")}
    own = {n: t.data_ptr() for n, t in model.items()}
    loader = WeightLoader(model)
    host = list(pack_buckets(_items("cpu"), version=1, bucket_bytes=8 << 20))
    loader.load([(n, t) for b in host for n, t in b.tensors()])
    torch.cuda.synchronize()
    assert all(t.is_cuda for t in model.values()) and loader.viewing == 0
    assert {n: t.data_ptr() for n, t in model.items()} == own
    assert all(torch.equal(model[n].cpu(), t) for n, t in _items("cpu"))
    dev = list(pack_buckets(_items("cuda"), version=2, bucket_bytes=8 << 20))
    loader.load([(n, t) for b in dev for n, t in b.tensors()])
    spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in dev]
    assert loader.viewing == len(model)
    assert all(t.is_cuda and any(a <= t.data_ptr() < z for a, z in spans) for t in model.values())
    host = list(pack_buckets(_items("cpu"), version=3, bucket_bytes=8 << 20))
    loader.load([(n, t) for b in host for n, t in b.tensors()])  # viewing, fed host bytes: fresh CUDA memory
    torch.cuda.synchronize()
    assert loader.viewing == 0 and all(t.is_cuda for t in model.values())
    assert not any(any(a <= t.data_ptr() < z for a, z in spans) for t in model.values())


@pytest.mark.gpu
def test_the_torch_engine_on_cuda_loads_host_and_cuda_updates_and_samples():
    from asyncflow_core.config.models import ModelConfig
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import GenerationRequest, SamplingParams
    from asyncflow_plugins.hf.model import build_causal_lm

    hf = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 48,
          "max_position_embeddings": 64, "tie_word_embeddings": True}

    async def feed(xs):
        for x in xs:
            yield x

    def export(seed: int, device: str):
        net = build_causal_lm(ModelConfig(hf_config=hf), seed=seed).to(device)
        seen, items = set(), []
        for name, t in net.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                items.append((name, t.detach()))
        return list(pack_buckets(items, version=seed, bucket_bytes=4096))

    async def main() -> None:
        engine = get_plugin_manager().create("rollout_engine", "torch", {"model": {"hf_config": hf},
                                                                         "device": "cuda", "eos_token_ids": []})
        await engine.start()
        try:
            for version, device in ((1, "cpu"), (2, "cuda"), (3, "cpu")):
                await engine.update_weights(version, feed(export(version, device)))
                assert all(t.is_cuda for t in engine._params.values()), f"version {version} from {device}"
                assert engine._net.lm_head.weight is engine._net.model.embed_tokens.weight
                (res,) = [r async for r in engine.generate([GenerationRequest(
                    f"r{version}", (1, 2, 3), SamplingParams(max_new_tokens=4))])]
                assert set(res.versions) == {version} and len(res.token_ids) == 4
        finally:
            await engine.shutdown()

    asyncio.run(main())
