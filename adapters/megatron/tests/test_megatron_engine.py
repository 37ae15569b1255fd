"""Tests of the ``megatron`` train engine.

Without megatron-core only the pure parts run (options, version check,
Hugging Face <-> Megatron mapping). With it, the engine runs on the CPU
(``device: cpu``: gloo, megatron-core's few CUDA-only calls patched in the
ranks, see asyncflow_megatron/cpu.py) at TP 2, PP 2 and DP 2 and is compared
with an independent oracle: a plain Hugging Face forward/backward in this
process on the same seed-built weights. The conformance suite runs on the
CPU path (marked ``slow``) and on CUDA (marked ``gpu``, skipped without a GPU).

Comparisons of floats allow for rounding order: thread counts, BLAS kernels,
the CPU's vector width and the TP/PP/DP split all change the order of
additions, so two correct runs differ by their rounding errors. Tolerances are
derived from the quantity (:func:`rounding_tol`), never a fixed 1e-5.

CI runs these through tests/adapters/test_megatron.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from asyncflow_core import columns as C
from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import AsyncflowError, EngineError
from asyncflow_core.interfaces import LossContext
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_megatron import hf_mapping as hm
from asyncflow_megatron.testing import TINY_QWEN2, cpu_options, gpu_options
from asyncflow_megatron.versions import check_version, supported_range
from asyncflow_plugins.hf.model import build_causal_lm, hf_config


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # a missing or blocked parent package
        return False


HAVE_MEGATRON = _have_megatron()
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install -e adapters/megatron)")
VOCAB = TINY_QWEN2["vocab_size"]

# ------------------------------------------------------------------ tolerances

#: float32 unit roundoff: the largest relative error of one rounding
U32 = torch.finfo(torch.float32).eps / 2
#: Higham & Mary, "A new approach to probabilistic rounding error analysis" (SIAM J. Sci. Comput. 41(5), 2019):
#: n additions in any order err by at most LAMBDA * sqrt(n) * u times the size of their terms, with probability
#: at least 1 - 2n exp(-LAMBDA^2 / 2), i.e. 1 - 3e-8 n at LAMBDA = 6
LAMBDA = 6.0
#: additions on the path from the input to one log-prob of TINY_QWEN2: per layer two RMSNorms, the q/k/v,
#: attention-output and gate/up projections (hidden_size each), scores and weighted values (at most hidden_size
#: together), the down projection (intermediate_size); then the final norm, the head and the log-softmax
FORWARD_TERMS = (TINY_QWEN2["num_hidden_layers"] * (6 * TINY_QWEN2["hidden_size"] + TINY_QWEN2["intermediate_size"])
                 + 2 * TINY_QWEN2["hidden_size"] + VOCAB)


def rounding_tol(terms: int, magnitude: float) -> float:
    """How far two float32 computations of one quantity may differ when only the order of additions differs.

    ``terms`` is the number of additions on the quantity's longest path and
    ``magnitude`` the size of its terms; each computation errs by at most
    ``LAMBDA * sqrt(terms) * u * magnitude`` (Higham & Mary), so their difference by twice that.
    """
    return 2 * LAMBDA * math.sqrt(terms) * U32 * magnitude


def logprob_tol(logprobs: torch.Tensor) -> float:
    """Log-probs of one forward pass, in two orders of addition (their size is the log-softmax's)."""
    return rounding_tol(FORWARD_TERMS, float(logprobs[torch.isfinite(logprobs)].abs().max()))


def grad_tol(batch: Batch, clip: float = 1.0) -> float:
    """One gradient element: the backward path, the forward path it uses, and the sum over the batch's positions.

    Gradients are clipped to the global norm ``clip`` before the step, which bounds every element and, in the
    terms' size, their sum over positions.
    """
    positions = batch[C.PROMPT_IDS].numel_packed + batch[C.RESPONSE_IDS].numel_packed
    return rounding_tol(2 * FORWARD_TERMS + positions, clip)


#: Adam's first step moves a weight by lr * g / (|g| + eps) (bias corrections cancel), whose slope in g is at
#: most lr / eps. With the default eps 1e-8 and lr 1e-2 that slope is 1e6: a gradient that is rounding noise
#: (the key bias in RoPE's slowest dimensions, where the key bias barely changes the scores, has |g| ~ 1e-9)
#: becomes a step of up to +-lr whose size and sign depend on the CPU's kernels. eps = lr bounds the slope by 1,
#: so the weights after one step carry the gradient, and its rounding error, unamplified.
STEP = {"lr": 1e-3, "eps": 1e-3}


def pinned_options(**overrides) -> dict:
    """The CPU engine's options for these tests: device and dtypes pinned, so no machine picks another path."""
    return cpu_options(**{"model": {"hf_config": dict(TINY_QWEN2), "dtype": "float32"}, "device": "cpu",
                          "params_dtype": "float32", "export_dtype": "float32", **overrides})


def tiny(model_type: str = "qwen2", **overrides) -> dict:
    cfg = {**TINY_QWEN2, "model_type": model_type, **overrides}
    if model_type == "qwen3":
        cfg.setdefault("head_dim", 16)  # Qwen3's head_dim does not follow hidden_size / heads
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    return build_causal_lm(ModelConfig(hf_config=cfg), seed=seed)


def arch_of(cfg: dict) -> hm.Architecture:
    return hm.architecture_from_hf(hf_config(ModelConfig(hf_config=cfg)))


# ------------------------------------------------------------------ options and versions


@pytest.mark.parametrize(("options", "needle"), [
    ({"world_size": 3, "tensor_parallel_size": 2}, "world_size 3 is not a multiple"),
    ({"world_size": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 4}, "= 2 x 4 = 8"),
    ({"sequence_parallel": True}, "sequence_parallel needs tensor_parallel_size > 1"),
    ({"sequence_parallel": True, "world_size": 2, "tensor_parallel_size": 2, "transformer_impl": "local"},
     "sequence_parallel needs transformer_impl transformer_engine"),
    ({"device": "cpu"}, "use_distributed_optimizer needs device cuda"),
    ({"device": "cpu", "use_distributed_optimizer": False, "transformer_impl": "transformer_engine"},
     "transformer_engine needs device cuda"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"bogus": 1}, "unknown field"),
])
def test_bad_options_are_one_line_config_errors(options, needle):
    with pytest.raises(AsyncflowError) as err:
        get_plugin_manager().create("train_engine", "megatron", options)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_registration_is_cheap_and_declares_features():
    found = get_plugin_manager().lookup("train_engine", "megatron")
    assert found.distribution == "asyncflow-megatron"
    record = found.record
    assert record.features.supports_checkpoint and record.features.supports_hf_export
    assert not record.features.supports_values


@pytest.mark.parametrize(("installed", "ok"), [
    ("0.16.1", True), ("0.16.0", True), ("0.16.1rc0", True), ("0.15.3", False), ("0.20.0", False),
    ("0.12.2", False), (None, False), ("garbage", False),
])
def test_version_check(installed, ok):
    if ok:
        assert str(check_version(installed)) == installed
        return
    with pytest.raises(EngineError) as err:
        check_version(installed)
    assert "pip install" in str(err.value) and supported_range() in str(err.value)


def test_supported_range_matches_the_package_pins():
    """pyproject.toml and versions.py state the same range (0.17+ needs Python 3.12)."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "megatron-core>=0.16.0,<=0.16.1; python_version < '3.12'" in text
    assert "megatron-core>=0.16.0,<0.20; python_version >= '3.12'" in text


# ------------------------------------------------------------------ architecture mapping


def test_qwen2_llama_qwen3_map_to_the_megatron_architecture():
    q2 = arch_of(tiny("qwen2"))
    assert (q2.qkv_bias, q2.qk_layernorm, q2.kv_channels, q2.num_query_groups, q2.heads_per_group) == (
        True, False, 8, 2, 2)
    llama = arch_of(tiny("llama"))
    assert (llama.qkv_bias, llama.qk_layernorm) == (False, False)
    q3 = arch_of(tiny("qwen3", tie_word_embeddings=True))
    assert (q3.qkv_bias, q3.qk_layernorm, q3.kv_channels, q3.tie_word_embeddings) == (False, True, 16, True)
    theta = arch_of(tiny("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert theta.rope_theta == 500000.0


@pytest.mark.parametrize(("cfg", "needle"), [
    ({"model_type": "gpt2", "n_embd": 32}, "model_type 'gpt2' is not supported"),
    ({"model_type": "qwen2", "hidden_size": 32}, "lacks intermediate_size, num_hidden_layers"),
    ({**TINY_QWEN2, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**TINY_QWEN2, "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type 'llama3'"),
    ({**TINY_QWEN2, "use_sliding_window": True}, "sliding-window"),
    ({**TINY_QWEN2, "model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({**TINY_QWEN2, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
])
def test_unsupported_architectures_are_refused_with_the_reason(cfg, needle):
    with pytest.raises(hm.UnsupportedArchitectureError) as err:
        hm.architecture_from_hf(cfg)
    assert needle in str(err.value)


def test_parallel_sizes_must_divide_the_model():
    arch = arch_of(tiny())
    hm.check_parallelism(arch, 2, 2)
    with pytest.raises(ValueError) as err:
        hm.check_parallelism(arch, 4, 3)
    message = str(err.value)
    assert "num_key_value_heads 2 is not a multiple of tensor_parallel_size 4" in message
    assert "num_hidden_layers 2 is not a multiple of pipeline_parallel_size 3" in message


@needs_megatron
def test_transformer_config_follows_the_hf_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from asyncflow_megatron.model import transformer_config_kwargs

    arch = arch_of(tiny("qwen3", rms_norm_eps=1e-5))
    cfg = TransformerConfig(**transformer_config_kwargs(arch, tp=1, pp=1, sequence_parallel=False,
                                                        params_dtype=torch.float32, cpu=True, recompute=False))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 32, 64)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5 and cfg.gated_linear_unit
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.calculate_per_token_loss and cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    # the CUDA settings (fused kernels, bf16, TP x PP, sequence parallelism, recompute) pass megatron's own checks
    gpu = TransformerConfig(**transformer_config_kwargs(arch, tp=2, pp=2, sequence_parallel=True,
                                                        params_dtype=torch.bfloat16, cpu=False, recompute=True))
    assert gpu.bf16 and gpu.variable_seq_lengths and gpu.recompute_granularity == "full"
    assert gpu.bias_activation_fusion and not gpu.use_cpu_initialization and gpu.perform_initialization


@needs_megatron
def test_a_bf16_stage_holds_no_float32_parameter():
    """The torch RMSNorm of the local spec is float32 whatever params_dtype says; the stage is cast whole.

    megatron-core 0.16.1's DistributedOptimizer mis-pairs state and ranges in a param group that mixes
    float32 and bf16 parameters (seen on the first CUDA run: the bf16 checkpoint save asserted).
    """
    from asyncflow_megatron.model import uniform_params_dtype

    stage = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.bfloat16), torch.nn.RMSNorm(4))
    stage.register_buffer("inv_freq", torch.ones(2))
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16, torch.float32}
    uniform_params_dtype(stage, torch.bfloat16)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert stage.inv_freq.dtype == torch.float32  # buffers (rotary frequencies) keep their precision


# ------------------------------------------------------------------ weight layout


def test_qkv_fusion_groups_query_heads_with_their_key_value_head():
    """GQA: 4 query heads over 2 key/value heads -> [q0 q1 k0 v0 | q2 q3 k1 v1], each head_dim rows."""
    arch = arch_of(tiny())
    d, h = arch.kv_channels, arch.hidden_size
    q = torch.arange(4).repeat_interleave(d).float()[:, None].expand(-1, h) + 0.0
    k = 10 + torch.arange(2).repeat_interleave(d).float()[:, None].expand(-1, h)
    v = 20 + torch.arange(2).repeat_interleave(d).float()[:, None].expand(-1, h)
    fused = hm.fuse_qkv(q, k, v, arch)
    heads = fused[::d, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]
    back = hm.split_qkv(fused, arch)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    bias = hm.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], arch)
    assert bias[::d].tolist() == heads


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_hf_to_megatron_and_back_is_bit_exact(model_type):
    cfg = tiny(model_type, tie_word_embeddings=model_type == "qwen3")
    arch = arch_of(cfg)
    hf = hf_model(cfg).state_dict()
    mc = hm.hf_to_megatron(hf, arch)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in mc
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) == (model_type == "qwen2")
    assert ("output_layer.weight" in mc) == (model_type != "qwen3")
    back = hm.megatron_to_hf(mc, arch)
    want = {k: v for k, v in hf.items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    assert list(back) == hm.hf_names(arch)
    assert set(back) == set(want)
    assert all(torch.equal(back[k], want[k]) for k in want)
    assert {k: tuple(v.shape) for k, v in back.items()} == hm.hf_shapes(arch)
    te = hm.hf_to_megatron(hf, arch, te_names=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert all(torch.equal(a, b) for a, b in zip(hm.megatron_to_hf(te, arch, te_names=True).values(),
                                                 back.values(), strict=True))


def test_a_state_dict_of_another_architecture_is_refused():
    arch = arch_of(tiny("qwen2"))
    llama = hf_model(tiny("llama")).state_dict()
    with pytest.raises(ValueError, match="does not match the qwen2 architecture: missing"):
        hm.hf_to_megatron(llama, arch)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_tp_pp_shards_reassemble_to_the_full_model(tp, pp):
    """Every rank's slice, merged back, is the full tensor; fc1 slices hold [gate slice; up slice]."""
    cfg = tiny("qwen2", vocab_size=47)  # odd vocab: padded to a multiple of TP
    arch = arch_of(cfg)
    full = hm.hf_to_megatron(hf_model(cfg).state_dict(), arch)
    shards = {(t, s): hm.shard_for_rank(full, arch, tp=tp, pp=pp, tp_rank=t, stage=s)
              for t in range(tp) for s in range(pp)}
    for name, tensor in full.items():
        stage = hm.stage_of(name, arch, pp)
        local = hm.to_local_name(name, arch, pp)
        assert hm.to_global_name(local, arch, pp, stage) == name
        pieces = [shards[(t, stage)][local] for t in range(tp)]
        assert torch.equal(hm.merge_tp(name, pieces, arch), tensor), name
    emb = shards[(0, 0)]["embedding.word_embeddings.weight"]
    assert emb.shape[0] == arch.padded_vocab_size(tp) // tp
    if tp == 2:
        gate, up = full["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2)
        rank1 = shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(rank1, torch.cat([gate[32:], up[32:]]))
    layers = {s: sorted({k.split(".")[2] for k in shards[(0, s)] if k.startswith("decoder.layers.")})
              for s in range(pp)}
    assert all(v == (["0", "1"] if pp == 1 else ["0"]) for v in layers.values())


# ------------------------------------------------------------------ the engine on CPU (gloo)


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def sample_batch(rows: int = 7, seed: int = 0) -> Batch:
    """Rows of uneven prompt and response lengths (padding, several micro-batches, uneven DP shares)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (2 + i % 4,), generator=gen) for i in range(rows)]
    responses = [torch.randint(0, VOCAB, (1 + (3 * i) % 5,), generator=gen) for i in range(rows)]
    return Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences(prompts),
        C.RESPONSE_IDS: RaggedTensor.from_sequences(responses),
        C.REWARD: (torch.arange(rows) % 3 == 0).float(),
        C.GROUP_ID: torch.arange(rows) // 3,
    })


def oracle_logprobs(net, batch: Batch, temperature=1.0, top_p=1.0, top_k=-1) -> torch.Tensor:
    """Each row alone through a plain HF forward, then the shared sampling convention."""
    out = []
    for prompt, response in zip(batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS], strict=True):
        logits = net(input_ids=torch.cat([prompt, response]).unsqueeze(0)).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, float64 kept
        p = prompt.numel()
        lp = sampling_logprobs(logits[p - 1: p - 1 + response.numel()], temperature, top_p, top_k)
        out.append(lp.gather(1, response.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def oracle_step(batch: Batch, algo, temperature: float, max_grad_norm: float = 1.0) -> tuple[float, float, dict]:
    """Full-batch loss, gradient norm and the weights after one clipped Adam step (``STEP``) on the HF model.

    In float64, so the oracle's own rounding is negligible next to the engine's float32.
    """
    net = hf_model(dict(TINY_QWEN2)).double().train()
    lp = oracle_logprobs(net, batch, temperature)
    resp = batch[C.RESPONSE_IDS]
    ctx = LossContext(global_tokens=resp.numel_packed, global_sequences=batch.num_rows, policy_version=0)
    loss, _ = algo.loss(RaggedTensor(lp, resp.offsets), batch, ctx)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
    torch.optim.Adam(net.parameters(), **STEP).step()
    return float(loss.detach()), float(norm), {k: v.detach() for k, v in net.state_dict().items()}


def assert_same_weights(got: dict, want: dict, batch: Batch, what: str) -> None:
    """Weights after one ``STEP`` agree to the step's slope (<= 1) times the gradient's rounding error."""
    assert set(got) == set(want), what
    for name, tensor in want.items():
        tol = STEP["lr"] / STEP["eps"] * grad_tol(batch) + 2 * U32 * float(tensor.abs().max())
        diff = float((got[name].double() - tensor.double()).abs().max())
        assert diff <= tol, (what, name, diff, tol)


def _rank_addresses(pids: list[int]) -> set[str]:
    """Every local and remote IP of the ranks' TCP/UDP sockets (rendezvous, gloo)."""
    import psutil

    found = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            found.add(conn.laddr.ip)
            if conn.raddr:
                found.add(conn.raddr.ip)
    return found


async def _exercise(options: dict, tmp: Path | None) -> dict:
    """Everything one engine is asked in these tests, so each layout starts its ranks once."""
    pm = get_plugin_manager()
    algo = pm.create("algorithm", "grpo", {})
    engine = pm.create("train_engine", "megatron", options)
    await engine.setup()
    out: dict = {"info": engine.info}
    try:
        batch = sample_batch()
        out["logprobs"] = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        out["addresses"] = _rank_addresses(engine.rank_pids)
        train = algo.compute_advantages(batch.with_columns(**{C.BEHAVIOR_LOGPROBS: out["logprobs"]}))
        out["train_batch"] = train
        out["metrics"] = await engine.train_step(train, algo)
        out["version"] = engine.version
        out["after"] = (await engine.compute_logprobs(batch))[C.LOGPROBS]
        buckets = [b async for b in engine.export_weights(bucket_bytes=4096)]
        for b in buckets:
            b.verify()
        out["buckets"] = buckets
        out["export"] = {name: t.clone() for b in buckets for name, t in b.tensors()}
        if tmp is not None:
            await engine.save(tmp / "ckpt")
            await engine.train_step(train, algo)
            out["second"] = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.load(tmp / "ckpt")
            out["loaded_version"] = engine.version
            out["reloaded"] = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.train_step(train, algo)
            out["second_again"] = (await engine.compute_logprobs(batch))[C.LOGPROBS]
            await engine.export_pretrained(tmp / "hf")
            with pytest.raises(ValueError, match="lacks columns"):
                await engine.train_step(batch, algo)
            with pytest.raises(ValueError, match="outside the model's vocabulary"):
                bad = batch.with_columns(**{C.RESPONSE_IDS: RaggedTensor.from_sequences(
                    [[VOCAB]] * batch.num_rows)})
                await engine.compute_logprobs(bad)
    finally:
        await engine.shutdown()
    return out


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    tmp = tmp_path_factory.mktemp("megatron1")
    out = run(_exercise(pinned_options(micro_batch_tokens=16, temperature=0.8, **STEP), tmp))
    out["tmp"] = tmp
    return out


LAYOUTS = {
    "tp2": {"world_size": 2, "tensor_parallel_size": 2},
    "pp2": {"world_size": 2, "pipeline_parallel_size": 2},
    "dp2": {"world_size": 2},
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def world2(request):
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    out = run(_exercise(pinned_options(micro_batch_tokens=16, temperature=0.8, **STEP, **LAYOUTS[request.param]),
                        None))
    out["layout"] = request.param
    return out


@needs_megatron
def test_cpu_logprobs_equal_a_plain_hf_forward(world1):
    """Padding, micro-batching and Megatron's GPTModel change nothing: log-probs equal an unpadded HF forward."""
    batch = sample_batch()
    with torch.no_grad():
        want = oracle_logprobs(hf_model(dict(TINY_QWEN2)), batch, temperature=0.8)
    got = world1["logprobs"]
    assert torch.equal(got.offsets, batch[C.RESPONSE_IDS].offsets)
    assert torch.allclose(got.values, want, rtol=0, atol=logprob_tol(want)), (got.values - want).abs().max()
    assert world1["info"]["backend"] == "gloo" and world1["info"]["impl"] == "local"


def step_tols(train: Batch, logprobs: torch.Tensor) -> tuple[float, float]:
    """Tolerances of a step's loss (absolute) and gradient norm (relative).

    The loss averages advantage-weighted ratios, so its error is the log-probs' times the mean |advantage|
    plus the rounding of the average; the norm's relative error is that of the gradient elements.
    """
    adv = float(train[C.ADVANTAGES].values.abs().mean())
    tokens = train[C.RESPONSE_IDS].numel_packed
    return adv * logprob_tol(logprobs) + rounding_tol(tokens, adv), grad_tol(train)


@needs_megatron
def test_cpu_train_step_equals_the_full_batch_oracle(world1):
    """Loss, gradient norm and every weight after one step (several micro-batches) equal the HF full-batch
    oracle's (float64, the same clipping and Adam step)."""
    algo = get_plugin_manager().create("algorithm", "grpo", {})
    train = world1["train_batch"]
    loss, norm, weights = oracle_step(train, algo, temperature=0.8)
    loss_tol, norm_rtol = step_tols(train, world1["logprobs"].values)
    m = world1["metrics"]
    assert m["micro_batches"] > 1
    assert m["loss"] == pytest.approx(loss, abs=loss_tol)
    assert m["grad_norm"] == pytest.approx(norm, rel=norm_rtol)
    assert world1["version"] == 1
    assert_same_weights(world1["export"], weights, train, "world 1 vs oracle")
    moved = (world1["after"].values - world1["logprobs"].values).abs().max()
    assert moved > 100 * logprob_tol(world1["logprobs"].values), "the step should move the log-probs visibly"


@needs_megatron
def test_cpu_export_is_the_hf_model_after_the_step(world1):
    """Buckets carry every Hugging Face name with HF shapes; the weights reproduce the engine's log-probs."""
    arch = arch_of(dict(TINY_QWEN2))
    exported = world1["export"]
    assert list(exported) == hm.hf_names(arch)
    assert {k: tuple(v.shape) for k, v in exported.items()} == hm.hf_shapes(arch)
    buckets = world1["buckets"]
    assert [b.index for b in buckets] == list(range(len(buckets))) and buckets[-1].last and len(buckets) > 1
    assert all(b.version == 1 for b in buckets)
    net = hf_model(dict(TINY_QWEN2))
    net.load_state_dict(exported)
    with torch.no_grad():
        want = oracle_logprobs(net, sample_batch(), temperature=0.8)
    assert torch.allclose(world1["after"].values, want, rtol=0, atol=logprob_tol(want))


@needs_megatron
def test_cpu_checkpoint_round_trip_restores_weights_and_optimizer(world1):
    """load() restores the version and the weights, and the next step repeats the one taken after save()."""
    assert world1["loaded_version"] == 1
    assert torch.equal(world1["reloaded"].values, world1["after"].values)
    assert torch.equal(world1["second_again"].values, world1["second"].values)
    assert (world1["tmp"] / "ckpt" / "asyncflow_megatron.json").is_file()


@needs_megatron
def test_cpu_export_pretrained_loads_in_transformers(world1):
    """The directory (written after the second step) loads in transformers and scores like the engine."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(world1["tmp"] / "hf"))
    assert type(net).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        want = oracle_logprobs(net, sample_batch(), temperature=0.8)
    assert torch.allclose(world1["second_again"].values, want, rtol=0, atol=logprob_tol(want))


@needs_megatron
def test_ranks_talk_on_loopback_only(world1, world2):
    """The rendezvous and gloo's own sockets bind and connect to loopback only (127.0.0.1, or it IPv4-mapped)."""
    import ipaddress

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    for out in (world1, world2):
        assert out["addresses"] and all(loopback(ip) for ip in out["addresses"]), out["addresses"]


@needs_megatron
def test_cpu_tp_pp_dp_agree_with_world1_and_the_oracle(world1, world2):
    """At TP 2, PP 2 and DP 2: same log-probs, same loss and gradient norm, same weights after the step.

    The layouts split the sums of the forward and backward passes differently, so results agree to rounding
    (:func:`rounding_tol`). The weights are compared after a step with eps = lr (``STEP``): Adam's first
    step is then a function of the gradient with slope at most 1, so this compares the gradients themselves,
    element by element, with the float64 oracle's and world 1's. With Adam's default eps 1e-8 the comparison
    would be of rounding noise amplified up to 1e6 times.
    """
    layout = world2["layout"]
    lp1 = world1["logprobs"].values
    assert torch.allclose(world2["logprobs"].values, lp1, rtol=0, atol=logprob_tol(lp1)), layout
    assert torch.allclose(world2["after"].values, world1["after"].values, rtol=0,
                          atol=logprob_tol(world1["after"].values)), layout
    loss_tol, norm_rtol = step_tols(world1["train_batch"], lp1)
    assert world2["metrics"]["loss"] == pytest.approx(world1["metrics"]["loss"], abs=loss_tol), layout
    assert world2["metrics"]["grad_norm"] == pytest.approx(world1["metrics"]["grad_norm"], rel=norm_rtol), layout
    assert list(world2["export"]) == list(world1["export"])
    assert_same_weights(world2["export"], world1["export"], world1["train_batch"], f"{layout} vs world 1")
    algo = get_plugin_manager().create("algorithm", "grpo", {})
    _, _, weights = oracle_step(world2["train_batch"], algo, temperature=0.8)
    assert_same_weights(world2["export"], weights, world2["train_batch"], f"{layout} vs oracle")


@needs_megatron
def test_setup_refuses_models_that_do_not_split():
    engine = get_plugin_manager().create("train_engine", "megatron", pinned_options(
        world_size=4, tensor_parallel_size=4))
    with pytest.raises(EngineError, match="num_key_value_heads 2 is not a multiple of tensor_parallel_size 4"):
        run(engine.setup())
    assert engine.rank_pids == []


@needs_megatron
def test_setup_refuses_an_unsupported_architecture():
    engine = get_plugin_manager().create("train_engine", "megatron", pinned_options(
        model={"hf_config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 16},
               "dtype": "float32"}))
    with pytest.raises(EngineError, match="model_type 'gpt2' is not supported"):
        run(engine.setup())


@needs_megatron
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    engine = get_plugin_manager().create("train_engine", "megatron", {"model": {"hf_config": dict(TINY_QWEN2)}})
    with pytest.raises(EngineError, match="needs one GPU per rank"):
        run(engine.setup())


# ------------------------------------------------------------------ conformance

try:
    from asyncflow_spec import TrainEngineSpec
except ImportError:  # pragma: no cover - the spec suite is a test dependency
    TrainEngineSpec = None

if TrainEngineSpec is not None:

    @pytest.mark.slow
    @needs_megatron
    class TestMegatronSpecCPU(TrainEngineSpec):
        """The whole TrainEngine contract on the CPU test path (world 1; about 45 s: one engine per test)."""

        backend = "megatron"
        options = pinned_options()

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_MEGATRON and torch.cuda.is_available()),
                        reason="needs CUDA and megatron-core (not run on a GPU yet)")
    class TestMegatronSpecGPU(TrainEngineSpec):
        backend = "megatron"
        options = gpu_options()

    @pytest.mark.gpu
    @pytest.mark.skipif(not (HAVE_MEGATRON and torch.cuda.device_count() >= 2),
                        reason="needs 2 GPUs and megatron-core (not run on a GPU yet)")
    class TestMegatronSpecGPUTP2(TrainEngineSpec):
        backend = "megatron"
        options = gpu_options(world_size=2, tensor_parallel_size=2)
