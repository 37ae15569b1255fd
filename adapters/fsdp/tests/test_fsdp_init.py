"""The ``fsdp`` engine's rank-side start: which CUDA device a rank takes, and the meta-device build.

CPU only (gloo): the build runs in spawned processes as the engine's ranks
run it (sharded meta skeleton, ``to_empty``, weights broadcast from rank 0),
and is compared with a plain Hugging Face model built in this process.
CI runs these through tests/adapters/test_fsdp_init.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow_core.config.models import ModelConfig
from asyncflow_fsdp.devices import rank_device
from asyncflow_fsdp.testing import TINY_QWEN2, meta_init_report
from asyncflow_plugins.hf.model import build_causal_lm


@pytest.mark.parametrize("visible", [1, 2, 4, 8])
def test_each_rank_takes_its_own_device(visible):
    """Ranks on one host with every GPU visible take GPU = rank; one GPU visible (a Ray rank actor): device 0."""
    world = visible if visible > 1 else 4
    devices = [rank_device(r, visible) for r in range(world)]
    assert all(d.type == "cuda" for d in devices)
    if visible > 1:
        assert [d.index for d in devices] == list(range(visible))
    else:
        assert {d.index for d in devices} == {0}


def test_a_rank_without_a_visible_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="rank 3 sees no CUDA device"):
        rank_device(3, 0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_device(-1, 2)


def _build(tmp_path, world: int, model: dict) -> list[dict]:
    mp.start_processes(meta_init_report, args=(world, str(tmp_path), model), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_build_has_the_hf_weights_and_buffers(tmp_path, tie):
    """At world 2: shards start on meta, end as the seed's float32 weights bit for bit; RoPE buffers and ties hold."""
    model = {"hf_config": dict(TINY_QWEN2, tie_word_embeddings=tie), "dtype": "bfloat16"}
    reports = _build(tmp_path, 2, model)
    # the engine's master weights: the model built in model.dtype, then float32 (as the build before sharding did)
    hf = build_causal_lm(ModelConfig.model_validate(model), seed=0).float()
    want = dict(hf.named_parameters())
    for rank, report in enumerate(reports):
        assert report["was_meta"], rank
        assert report["tied"] is tie, rank
        assert list(report["params"]) == list(want), rank
        for name, tensor in want.items():
            got = report["params"][name]
            assert got.dtype == torch.float32 and torch.equal(got, tensor.detach()), (rank, name)
        buffers = dict(hf.named_buffers())
        assert list(report["buffers"]) == list(buffers) and buffers, rank
        for name, tensor in buffers.items():  # e.g. rotary inv_freq, which state_dict leaves out
            assert torch.equal(report["buffers"][name], tensor.float()), (rank, name)
    total = sum(p.numel() for p in want.values())
    assert all(r["local_numel"] < total for r in reports)  # each rank holds a shard, never the whole model
    assert sum(r["local_numel"] for r in reports) >= total


def test_rank0_releases_each_source_tensor_once_sent(tmp_path, monkeypatch):
    """One rank (gloo, in this process), a bfloat16 source: each source tensor is released once sent, so at every
    step the source's remaining elements plus those sent stay within one model plus one tensor (no whole float32
    copy); afterwards the source is empty and the sharded model holds the seed's weights, cast to float32, bit for
    bit (tied embeddings sent once)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncflow_fsdp import init
    from asyncflow_fsdp.init import materialize_from_rank0, meta_skeleton
    from asyncflow_fsdp.worker import _decoder_blocks

    cfg = ModelConfig.model_validate({"hf_config": dict(TINY_QWEN2, tie_word_embeddings=True), "dtype": "bfloat16"})
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        source = build_causal_lm(cfg, seed=0)
        assert next(source.parameters()).dtype == torch.bfloat16
        want = {n: p.detach().float() for n, p in source.named_parameters()}
        total = sum(t.numel() for t in want.values())
        largest = max(t.numel() for t in want.values())
        net = meta_skeleton(cfg)
        mesh = init_device_mesh("cpu", (1,))
        for block in _decoder_blocks(net):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        held: list[int] = []
        received = [0]
        receive = init._receive

        def spy(target, theirs, rank):
            receive(target, theirs, rank)
            received[0] += target.numel()
            held.append(sum(p.numel() for p in source.parameters()) + received[0])

        monkeypatch.setattr(init, "_receive", spy)
        materialize_from_rank0(net, source, torch.device("cpu"))
        got = {n: p.full_tensor() for n, p in net.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert len(held) == len(want)  # one send per tensor: the tied pair once
    assert max(held) <= total + largest, (max(held), total)
    assert sum(p.numel() for p in source.parameters()) == 0
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
