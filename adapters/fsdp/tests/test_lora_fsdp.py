"""LoRA in the ``fsdp`` engine (``lora`` option / ``trainer.lora``): peft adapters on a frozen, FSDP2-sharded base.

On a tiny random Qwen2, on CPU with gloo, at world size 1 and 2, pinned to
float32. What is checked:

- only the adapter trains: the base's shards are bitwise unchanged after
  steps, the optimizer holds exactly the adapter's parameters;
- ``export_weights`` sends the whole base at version 0 and afterwards exactly
  the adapter's tensors under ``peft.get_peft_model_state_dict`` names, which
  a receiver takes with ``collect_update(..., partial=names)`` and which,
  applied to the seed's base, reproduce the engine's log-probs;
- checkpoints hold the adapter and its optimizer state (bitwise round trip)
  and resume at another world size;
- ``export_pretrained`` writes the merged model (loads with
  ``AutoModelForCausalLM``) or a peft adapter directory (loads with
  ``PeftModel.from_pretrained``), both scoring as the engine does.

Tolerances follow tests/test_fsdp_engine.py: float32 rounding of the
additions on a quantity's path (Higham & Mary's probabilistic bound),
never a fixed 1e-5. CI runs these through tests/test_lora_fsdp.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'asyncflow[lora]')")

from peft import PeftModel, set_peft_model_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import EngineError  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import Batch, ModelTensors, RaggedTensor, collect_update  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_fsdp.testing import TINY_QWEN2, local_rank, tiny_options, train_payload  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402

VOCAB = TINY_QWEN2["vocab_size"]
LAYERS = TINY_QWEN2["num_hidden_layers"]
RANK = 4
LORA = {"rank": RANK, "alpha": 8}
#: eps = lr keeps Adam's slope in the gradient at most 1 (see test_fsdp_engine.STEP)
STEP = {"lr": 1e-3, "eps": 1e-3}

U32 = torch.finfo(torch.float32).eps / 2
LAMBDA = 6.0
#: additions on one logit's path in TINY_QWEN2 (as in test_fsdp_engine), plus each adapter's rank-r sums
FORWARD_TERMS = (LAYERS * (6 * TINY_QWEN2["hidden_size"] + TINY_QWEN2["intermediate_size"] + 7 * RANK)
                 + 2 * TINY_QWEN2["hidden_size"] + VOCAB)


def rounding_tol(terms: int, magnitude: float) -> float:
    """Two float32 computations of one quantity that differ only in the order of ``terms`` additions."""
    return 2 * LAMBDA * math.sqrt(terms) * U32 * magnitude


def tol_of(values: torch.Tensor) -> float:
    return rounding_tol(FORWARD_TERMS, float(values[torch.isfinite(values)].abs().max()))


def options(**overrides) -> dict:
    return tiny_options(**{"model": {"hf_config": dict(TINY_QWEN2), "dtype": "float32"}, "device": "cpu",
                           "mixed_precision": "float32", "export_dtype": "float32", "lora": dict(LORA),
                           **overrides})


def make(**overrides):
    return get_plugin_manager().create("train_engine", "fsdp", options(**overrides))


def run(coro, timeout: float = 180.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def grpo():
    return get_plugin_manager().create("algorithm", "grpo", {})


def sample_batch(rows: int = 7, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (2 + i % 4,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, VOCAB, (1 + (3 * i) % 5,), generator=gen) for i in range(rows)]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
        C.REWARD: (torch.arange(rows) % 3 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


def base_model() -> torch.nn.Module:
    """The seed's base model, as every engine of the run builds it."""
    return build_causal_lm(ModelConfig(hf_config=dict(TINY_QWEN2)), seed=0)


def peft_model(adapter: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The seed's base with this test's adapter; ``adapter`` (exported names) loaded into it."""
    net = wrap(base_model(), LoraSpec(**LORA))
    if adapter is not None:
        result = set_peft_model_state_dict(net, adapter)
        assert not result.unexpected_keys, result.unexpected_keys
    return net.eval()


def oracle_logprobs(net, batch: Batch) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
            logits = net(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0].float()
            p = prompt.numel()
            lp = sampling_logprobs(logits[p - 1: p - 1 + response.numel()], 1.0)
            out.append(lp.gather(1, response.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def with_advantages(batch: Batch, logp: RaggedTensor, algo) -> Batch:
    return algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: logp}))


async def export(engine) -> tuple[list, dict[str, torch.Tensor]]:
    buckets = [b async for b in engine.export_weights(bucket_bytes=4096)]
    return buckets, {name: t.clone() for b in buckets for name, t in b.tensors()}


# ------------------------------------------------------------------ in-process rank (white box)


def _rank_logprobs(worker, batch: Batch) -> RaggedTensor:
    logps, _ = worker.op_logprobs({"batch": batch, "micro_batches": [torch.arange(batch.num_rows)], "passes": 1,
                                   "values": False})
    return RaggedTensor.from_sequences(logps, dtype=torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard), or the tensor itself (an unsharded rank)."""
    return t.to_local() if hasattr(t, "to_local") else t


def test_only_the_adapter_trains_and_the_base_stays_bitwise():
    """After two steps every base shard is bitwise what it was; the adapter moved; the optimizer holds exactly
    the trainable (lora_*) parameters."""
    algo, batch = grpo(), sample_batch()
    with local_rank(options(**STEP)) as worker:
        named = dict(worker.model.named_parameters())
        trainable = {n for n, p in named.items() if p.requires_grad}
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
        assert sum(p.numel() for n, p in named.items() if n in trainable) < sum(p.numel() for p in named.values()) / 4
        in_optimizer = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        assert in_optimizer == {id(named[n]) for n in trainable}
        before = {n: _local(p).detach().clone() for n, p in named.items()}
        train = with_advantages(batch, _rank_logprobs(worker, batch), algo)
        for version in range(2):
            reply = worker.op_train(train_payload(train, algo, version))
            assert reply["stepped"] and reply["grad_norm"] > 0
        after = {n: _local(p).detach() for n, p in worker.model.named_parameters()}
    for name in named:
        if name in trainable:
            continue
        assert torch.equal(after[name], before[name]), f"frozen {name} changed"
    moved = [n for n in trainable if ".lora_B." in n and not torch.equal(after[n], before[n])]
    assert len(moved) == len([n for n in trainable if ".lora_B." in n])  # B starts at 0 and every B learned


def test_checkpoint_holds_adapter_and_optimizer_state_bitwise(tmp_path):
    """save -> a fresh rank -> load: the adapter and every optimizer tensor (moments, step) are bitwise equal, and
    the checkpoint holds no frozen base tensor."""
    algo, batch = grpo(), sample_batch()
    with local_rank(options(**STEP)) as worker:
        train = with_advantages(batch, _rank_logprobs(worker, batch), algo)
        worker.op_train(train_payload(train, algo, 0))
        worker.op_save({"path": str(tmp_path / "ckpt"), "version": 1})
        model_sd, optim_sd = get_state_dict(worker.holder, worker.optimizer, options=worker._state_options())
        saved = _flatten({"model": model_sd, "optim": optim_sd})
    assert saved and all("lora_" in k for k in saved if k.startswith("model."))
    with local_rank(options(**STEP, seed=0)) as worker:
        assert worker.op_load({"path": str(tmp_path / "ckpt")}) == 1
        model_sd, optim_sd = get_state_dict(worker.holder, worker.optimizer, options=worker._state_options())
        loaded = _flatten({"model": model_sd, "optim": optim_sd})
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value), key
        else:
            assert got == value, key
    assert any(".exp_avg_sq" in k or "exp_avg_sq" in k for k in saved)  # the optimizer state is really there


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        value = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        out[prefix.rstrip(".")] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


# ------------------------------------------------------------------ the engine (driver + ranks)


def test_adapter_update_carries_exactly_the_adapter_and_reproduces_the_policy_world2():
    """Version 0 is the seed's base under the plain model's names (bitwise); version 1 carries exactly the
    adapter's tensors (peft names), a known fraction of the bytes; a receiver takes it as a partial update and,
    applied to the base, it scores as the engine does."""
    algo, batch = grpo(), sample_batch()

    async def body():
        engine = make(world_size=2, micro_batch_tokens=20)
        await engine.setup()
        try:
            assert engine.features.supports_lora
            assert engine.info["trainable_parameters"] < engine.info["parameters"]
            v0_buckets, v0 = await export(engine)
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(with_advantages(batch, lp, algo), algo)
            v1_buckets, v1 = await export(engine)
            after = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            return v0_buckets, v0, v1_buckets, v1, after
        finally:
            await engine.shutdown()

    v0_buckets, v0, v1_buckets, v1, engine_lp = run(body())
    base = base_model().state_dict()
    assert set(v0) == set(base)
    for name, tensor in base.items():
        assert torch.equal(v0[name], tensor), name

    expected = adapter_state_dict(peft_model())
    assert set(v1) == set(expected)
    assert all(tuple(v1[n].shape) == tuple(t.shape) for n, t in expected.items())
    # bytes: exactly the adapter's (aligned) tensors, far below the full model's
    from asyncflow_core.launchers.rank_worker import aligned

    v0_bytes, v1_bytes = sum(b.nbytes for b in v0_buckets), sum(b.nbytes for b in v1_buckets)
    assert v1_bytes == sum(aligned(t.numel() * 4) for t in expected.values())
    assert v0_bytes == sum(aligned(t.numel() * 4) for t in base.values())
    assert v1_bytes < v0_bytes / 3

    receiver = peft_model()
    received = run(collect_update(1, _aiter(v1_buckets), model=ModelTensors.of(adapter_state_dict(receiver)),
                                  partial=set(expected)))
    applied = {name: t.clone() for b in received for name, t in b.tensors()}
    set_peft_model_state_dict(receiver, applied)
    want = oracle_logprobs(receiver, batch)
    assert torch.allclose(engine_lp.values, want, rtol=0, atol=tol_of(want))
    # and the update matters: the base alone scores differently by far more than rounding
    base_lp = oracle_logprobs(peft_model(), batch)
    assert float((base_lp - want).abs().max()) > 100 * tol_of(want)


async def _aiter(items):
    for item in items:
        yield item


def test_checkpoint_resumes_at_world_1_and_2_and_refuses_another_adapter(tmp_path):
    """save at world 2 after one step; load at world 2 or 1; the second step gives the uninterrupted engine's
    adapter (optimizer state restored: a lost moment changes the step by ~lr, far above rounding). A checkpoint of
    another rank is refused with the reason."""
    algo, batch = grpo(), sample_batch()

    async def straight():
        engine = make(world_size=2, micro_batch_tokens=20, **STEP)
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            train = with_advantages(batch, lp, algo)
            await engine.train_step(train, algo)
            await engine.save(tmp_path / "ckpt")
            await engine.train_step(train, algo)
            return train, (await export(engine))[1]
        finally:
            await engine.shutdown()

    async def resumed(world: int, train):
        engine = make(world_size=world, micro_batch_tokens=20, **STEP)
        await engine.setup()
        try:
            await engine.load(tmp_path / "ckpt")
            assert engine.version == 1
            await engine.train_step(train, algo)
            return (await export(engine))[1]
        finally:
            await engine.shutdown()

    train, want = run(straight())
    positions = train[C.PROMPT_IDS].numel_packed + train[C.RESPONSE_IDS].numel_packed
    for world in (2, 1):
        got = run(resumed(world, train))
        assert set(got) == set(want)
        for name, tensor in want.items():
            # Adam's second step has slope <= 1.5 lr/eps in the gradient; the gradient errs by its rounding
            tol = 1.5 * rounding_tol(2 * FORWARD_TERMS + positions, 1.0) + 2 * U32 * float(tensor.abs().max())
            assert float((got[name] - tensor).abs().max()) <= tol, (world, name)

    async def other_rank():
        engine = make(world_size=1, lora={"rank": RANK * 2, "alpha": 8})
        await engine.setup()
        try:
            await engine.load(tmp_path / "ckpt")
        finally:
            await engine.shutdown()

    with pytest.raises(EngineError, match=r"saved with trainer.lora=.*'rank': 4.*use the same rank"):
        run(other_rank())


def test_export_pretrained_merged_and_adapter_score_as_the_engine(tmp_path):
    """export merged -> AutoModelForCausalLM; export adapter -> PeftModel.from_pretrained on the seed's base.
    The adapter directory gives bitwise the model the exported update builds; the merged model its logits to
    rounding (W + s B A folded vs applied)."""
    from transformers import AutoModelForCausalLM

    algo, batch = grpo(), sample_batch()

    async def body():
        engine = make(world_size=2, micro_batch_tokens=20)
        await engine.setup()
        try:
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(with_advantages(batch, lp, algo), algo)
            await engine.export_pretrained(tmp_path / "merged")
            await engine.save(tmp_path / "ckpt")
            return (await export(engine))[1]
        finally:
            await engine.shutdown()

    async def adapter_dir():
        engine = make(world_size=1, lora={**LORA, "export": "adapter"})
        await engine.setup()
        try:
            await engine.load(tmp_path / "ckpt")
            await engine.export_pretrained(tmp_path / "adapter")
        finally:
            await engine.shutdown()

    update = run(body())
    run(adapter_dir())
    reference = peft_model(update)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    assert not any("lora" in n for n in merged.state_dict())
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    from_dir = PeftModel.from_pretrained(base_model(), tmp_path / "adapter").eval()
    with torch.no_grad():
        for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
            ids = torch.cat([prompt, response]).unsqueeze(0)
            want = reference(input_ids=ids).logits
            assert torch.equal(from_dir(input_ids=ids).logits, want)
            got = merged(input_ids=ids).logits
            assert torch.allclose(got, want, rtol=0, atol=tol_of(want)), float((got - want).abs().max())


def test_a_target_that_matches_no_layer_is_one_clear_line():
    async def body():
        engine = make(world_size=1, lora={"target_modules": ["qkv_proj"]})
        try:
            await engine.setup()
        finally:
            await engine.shutdown()

    with pytest.raises(EngineError, match=r"target_modules \['qkv_proj'\] match no layer of Qwen2ForCausalLM; its "
                                          r"linear layers are \[.*'q_proj'"):
        run(body())


def test_lora_option_comes_from_trainer_lora():
    """The engine's ``lora`` option validates as the run's ``trainer.lora`` (one LoraSpec model)."""
    from asyncflow_fsdp.config import FSDPTrainConfig

    opts = FSDPTrainConfig.model_validate(options())
    assert opts.lora == LoraSpec(**LORA)
    assert FSDPTrainConfig.model_validate(options(lora=None)).lora is None


def test_modules_to_save_train_in_full_and_travel_with_the_adapter(tmp_path):
    """``modules_to_save: [lm_head]``: the head's trainable copy is in the update (under peft's name) and in the
    merged export; version 0 still sends the base head under its plain name."""
    from transformers import AutoModelForCausalLM

    algo, batch = grpo(), sample_batch()
    spec = {**LORA, "modules_to_save": ["lm_head"]}

    async def body():
        engine = make(world_size=2, micro_batch_tokens=20, lora=spec)
        await engine.setup()
        try:
            v0 = (await export(engine))[1]
            lp = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(with_advantages(batch, lp, algo), algo)
            await engine.export_pretrained(tmp_path / "merged")
            return v0, (await export(engine))[1]
        finally:
            await engine.shutdown()

    v0, v1 = run(body())
    base = base_model().state_dict()
    assert set(v0) == set(base) and torch.equal(v0["lm_head.weight"], base["lm_head.weight"])
    expected = adapter_state_dict(wrap(base_model(), LoraSpec(**spec)))
    assert set(v1) == set(expected) and "base_model.model.lm_head.weight" in v1
    head = v1["base_model.model.lm_head.weight"]
    assert not torch.equal(head, base["lm_head.weight"])  # trained in full
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(merged.state_dict()["lm_head.weight"], head)


def test_dropout_acts_in_train_steps_only():
    """With ``dropout: 0.5`` log-probs stay deterministic before and after a train step (eval mode restored)."""
    algo, batch = grpo(), sample_batch()

    async def body():
        engine = make(world_size=1, lora={**LORA, "dropout": 0.5})
        await engine.setup()
        try:
            first = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            assert torch.equal((await engine.compute_logprobs(batch))[C.LOGPROBS].values, first.values)
            await engine.train_step(with_advantages(batch, first, algo), algo)
            after = [(await engine.compute_logprobs(batch))[C.LOGPROBS].values for _ in range(2)]
            return first, after
        finally:
            await engine.shutdown()

    first, after = run(body())
    assert torch.equal(after[0], after[1])
    assert not torch.equal(after[0], first.values)


# ------------------------------------------------------------------ memory: chunked head, checkpointing


def _sharded_options(**overrides) -> dict:
    """A world-1 rank that wraps the model in FSDP2 (``shard: always`` where the engine has that option)."""
    from asyncflow_fsdp.config import FSDPTrainConfig

    extra = {"shard": "always"} if "shard" in FSDPTrainConfig.model_fields else {}
    return options(**extra, **overrides)


def _adapter_grads(worker, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward/backward of the rank's scoring path: log-probs, the adapter's gradients, and the elements
    autograd kept from forward to backward (parameters excluded)."""
    kept = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = worker._score(batch, with_values=False)
    (lp * torch.linspace(-1.0, 1.0, lp.numel())).sum().backward()
    grads = {n: _local(p.grad).clone()
             for n, p in worker.model.named_parameters() if p.grad is not None}
    worker.optimizer.zero_grad(set_to_none=True)
    return lp.detach(), grads, kept[0]


def test_chunked_head_and_checkpointing_give_the_same_adapter_gradients(monkeypatch):
    """On a sharded rank, the adapter's gradients from the whole-logits head, from 2-token chunks, and from chunks
    with ``gradient_checkpointing`` (which acts in eval mode too: the rank scores without dropout) agree to
    rounding; checkpointing keeps a fraction of the activations for backward; only the adapter gets gradients."""
    from asyncflow_fsdp import forward

    batch = sample_batch()
    lora = {"rank": RANK, "alpha": 8}
    runs = {}
    with local_rank(_sharded_options(lora=lora)) as worker:
        with torch.no_grad():  # B starts at 0: give it a value so gradients reach A as well
            for name, p in worker.model.named_parameters():
                if ".lora_B." in name:
                    _local(p).fill_(0.05)
        for label, chunk in (("whole", 0), ("chunked", 2 * VOCAB * 4)):
            monkeypatch.setattr(forward, "LOGITS_CHUNK_BYTES", chunk)
            runs[label] = _adapter_grads(worker, batch)
    monkeypatch.setattr(forward, "LOGITS_CHUNK_BYTES", 2 * VOCAB * 4)
    with local_rank(_sharded_options(lora=lora, gradient_checkpointing=True)) as worker:
        with torch.no_grad():
            for name, p in worker.model.named_parameters():
                if ".lora_B." in name:
                    _local(p).fill_(0.05)
        modes = [m.training for m in worker.model.modules()]
        runs["checkpointed"] = _adapter_grads(worker, batch)
        assert [m.training for m in worker.model.modules()] == modes  # the layers' modes are restored
    want_lp, want, kept_whole = runs["whole"]
    assert want and all(".lora_" in n for n in want)
    terms = 2 * FORWARD_TERMS + want_lp.numel()
    for label in ("chunked", "checkpointed"):
        lp, grads, _ = runs[label]
        assert torch.allclose(lp, want_lp, rtol=0, atol=tol_of(want_lp)), label
        assert set(grads) == set(want), label
        for name, g in want.items():
            assert float((grads[name] - g).abs().max()) <= rounding_tol(terms, float(g.abs().max())), (label, name)
    assert runs["checkpointed"][2] < kept_whole / 3  # the layers' activations are recomputed, not kept
