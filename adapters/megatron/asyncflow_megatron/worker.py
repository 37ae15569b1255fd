"""The rank side: one process per rank, serving the driver's commands over a pipe.

A rank owns one tensor-parallel slice of one pipeline stage of one model
replica, and its shard of the distributed optimizer. The driver
(:class:`asyncflow_megatron.engine.MegatronTrainEngine`) sends every rank of
a data-parallel replica the same rows; every rank then runs the same
megatron-core collectives in the same order (the pipeline schedule, the
gradient reduce-scatter and parameter all-gather of the distributed
optimizer, the export gathers, dist_checkpointing's exchange) and answers.
The protocol (pipe, rendezvous, shared-memory export, checkpoint frame) is
the core's :mod:`asyncflow_core.launchers.rank_worker`; this module holds
what Megatron does.
"""

from __future__ import annotations

import functools
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.launchers import rank_worker as rw
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_core.types.sampling import sampling_logprobs
from asyncflow_megatron import checkpoint as mc
from asyncflow_megatron import hf_mapping as hm
from asyncflow_megatron.config import MegatronTrainConfig

PAD_ID = 0  #: filler after each row; never attended to by a real token (causal attention)


def rank_main(rank: int, world_size: int, conn: Any, options: dict[str, Any]) -> None:
    """Entry point of a rank process: answer commands until ``shutdown`` or until the driver goes away."""
    # dist_checkpointing's file writer starts a helper process, and a daemonic process may not have children.
    # This only changes what this process may do: the driver still reaps it (RankGroup.stop), and it exits
    # when the driver's pipe closes.
    multiprocessing.current_process().daemon = False
    rw.serve(RankWorker(rank, world_size, MegatronTrainConfig.model_validate(options)), conn)


class _Layout:
    """Rows right-padded into ``[rows, width]``; where each response token's predicting logit sits."""

    def __init__(self, mb: Batch, multiple: int) -> None:
        prompts: RaggedTensor = mb[C.PROMPT_IDS]  # type: ignore[assignment]
        responses: RaggedTensor = mb[C.RESPONSE_IDS]  # type: ignore[assignment]
        p_len, r_len = prompts.lengths, responses.lengths
        rows = len(p_len)
        width = max(int((p_len + r_len).max()), 1)
        width = -(-width // multiple) * multiple  # sequence parallelism splits the sequence over TP ranks
        ids = torch.full((rows, width), PAD_ID, dtype=torch.int64)
        for i in range(rows):
            p, r = int(p_len[i]), int(r_len[i])
            ids[i, :p] = prompts.values[prompts.offsets[i]: prompts.offsets[i + 1]]
            ids[i, p: p + r] = responses.values[responses.offsets[i]: responses.offsets[i + 1]]
        self.input_ids = ids
        self.row = torch.repeat_interleave(torch.arange(rows), r_len)
        within = torch.arange(responses.numel_packed) - torch.repeat_interleave(responses.offsets[:-1], r_len)
        # response token j of row i sits at p_i + j and is predicted by position p_i + j - 1
        self.position = torch.repeat_interleave(p_len, r_len) - 1 + within
        self.targets = responses.values.to(torch.int64)
        self.offsets = responses.offsets
        self.lengths = r_len


class RankWorker(rw.RankWorkerBase):
    """State of one rank: process groups, its GPTModel stage (wrapped in Megatron DDP), optimizer."""

    engine_name = "megatron"
    config: MegatronTrainConfig

    def __init__(self, rank: int, world_size: int, config: MegatronTrainConfig) -> None:
        super().__init__(rank, world_size, config)
        self.arch: hm.Architecture | None = None
        self.model: Any = None  # megatron DistributedDataParallel around the GPTModel stage
        self.optimizer: Any = None
        self.impl = "local"
        self.tp = self.pp = self.dp = 1
        self.tp_rank = self.pp_rank = self.dp_rank = 0
        self._export_chunks: list[list[str]] = []
        self._hf_config: Any = None

    # -- start ------------------------------------------------------------------

    def op_setup(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Join the group on loopback, set up parallel state, build the stage, load weights, DDP, optimizer."""
        c = self.config
        cpu = c.device == "cpu"
        if cpu:
            self.set_cpu_threads()
            from asyncflow_megatron import cpu as cpu_patch

            cpu_patch.enable()
        else:
            self.device = rw.rank_device(self.rank, torch.cuda.device_count())
            torch.cuda.set_device(self.device)  # before anything allocates on CUDA (NCCL's communicator too)
        backend = "gloo" if cpu else "nccl"
        self.join_group(int(payload["port"]), backend)

        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        from asyncflow_megatron.model import build_gpt_model, resolve_impl, transformer_config_kwargs
        from asyncflow_plugins.hf.model import build_causal_lm, hf_config

        ps.initialize_model_parallel(tensor_model_parallel_size=c.tensor_parallel_size,
                                     pipeline_model_parallel_size=c.pipeline_parallel_size)
        self.tp, self.pp, self.dp = (ps.get_tensor_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size())
        self.tp_rank, self.pp_rank, self.dp_rank = (ps.get_tensor_model_parallel_rank(),
                                                    ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
        if not cpu:
            tensor_parallel.model_parallel_cuda_manual_seed(c.seed)
        assert c.model is not None
        self._hf_config = hf_config(c.model)
        arch = hm.architecture_from_hf(self._hf_config)
        self.arch = arch
        self.impl = resolve_impl(c.transformer_impl, self.device.type)
        params_dtype = torch.float32 if cpu else rw.DTYPES[c.params_dtype]
        tconfig = TransformerConfig(**transformer_config_kwargs(
            arch, tp=self.tp, pp=self.pp, sequence_parallel=c.sequence_parallel, params_dtype=params_dtype, cpu=cpu,
            recompute=c.recompute_activations))
        net = build_gpt_model(arch, tconfig, impl=self.impl)

        # initial weights: the Hugging Face model (a checkpoint, or built from the seed exactly as the rollout
        # engines build it), converted and sliced for this rank. Every rank holds the whole model in CPU memory
        # for a moment (in model.dtype): simple, and fine up to a few billion parameters per node
        hf = build_causal_lm(c.model, seed=c.seed)
        full = hm.hf_to_megatron(hf.state_dict(), arch, te_names=self.impl == "transformer_engine")
        del hf
        local = hm.shard_for_rank(full, arch, tp=self.tp, pp=self.pp, tp_rank=self.tp_rank, stage=self.pp_rank)
        params = dict(net.named_parameters())
        if set(params) != set(local):
            raise RuntimeError(f"weight mapping mismatch on rank {self.rank}: model has "
                               f"{sorted(set(params) - set(local))[:4]} unmapped, mapping has "
                               f"{sorted(set(local) - set(params))[:4]} unused")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(local[name].to(p.dtype))
        del full, local
        net.to(self.device)

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=c.use_distributed_optimizer, average_in_collective=False)
        self.model = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=net)
        # LossContext already normalises by the whole step's tokens: finalize only reduces, never rescales
        tconfig.finalize_model_grads_func = functools.partial(_finalize_without_token_scaling, finalize_model_grads)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=c.lr, min_lr=c.lr, weight_decay=c.weight_decay,
                            adam_beta1=c.betas[0], adam_beta2=c.betas[1], adam_eps=c.eps, clip_grad=c.max_grad_norm,
                            bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                            use_distributed_optimizer=c.use_distributed_optimizer),
            [self.model])
        return {
            "vocab_size": arch.vocab_size,
            "parameters": sum(p.numel() for p in net.parameters()),
            "device": str(self.device),
            "backend": backend,
            "impl": self.impl,
            "architecture": arch.model_type,
            "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
            "tp": self.tp, "pp": self.pp, "dp": self.dp,
        }

    # -- forward / train --------------------------------------------------------

    def _seq_multiple(self) -> int:
        return self.tp if self.config.sequence_parallel else 1

    def _logprobs(self, logits: torch.Tensor, lay: _Layout) -> torch.Tensor:
        """Response-token log-probs under the shared sampling convention (float32, grad kept when enabled)."""
        c = self.config
        assert self.arch is not None
        picked = logits[lay.row.to(logits.device), lay.position.to(logits.device)][..., : self.arch.vocab_size]
        logp = sampling_logprobs(picked.float(), c.temperature, c.top_p, c.top_k)
        return logp.gather(1, lay.targets.to(logits.device).unsqueeze(1)).squeeze(1)

    def _run_schedule(self, micro: list[Batch], loss_func: Any, *, forward_only: bool) -> list[Any]:
        """Megatron's pipeline schedule over ``micro``; ``loss_func(index, mb, layout, logits)`` on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        layouts = [_Layout(mb, self._seq_multiple()) for mb in micro]
        items = iter(list(enumerate(zip(micro, layouts, strict=True))))
        causal_mask = self.impl == "local"  # Transformer Engine builds its own causal mask

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            index, (mb, lay) = next(data_iterator)
            ids = lay.input_ids.to(self.device)
            rows, width = ids.shape
            positions = torch.arange(width, device=self.device).unsqueeze(0).expand(rows, -1)
            mask = (torch.triu(torch.ones(width, width, dtype=torch.bool, device=self.device), diagonal=1)[None, None]
                    if causal_mask else None)
            output = model(ids, positions, mask)
            return output, functools.partial(loss_func, index, mb, lay)

        width = max(lay.input_ids.shape[1] for lay in layouts)
        rows = max(lay.input_ids.shape[0] for lay in layouts)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=items, model=[self.model], num_microbatches=len(micro),
            seq_length=width, micro_batch_size=rows, forward_only=forward_only)

    def op_logprobs(self, payload: dict[str, Any]) -> list[torch.Tensor] | None:
        """Per-row log-probs of this replica's rows, in row order (answered by the last stage's TP rank 0)."""
        batch: Batch = payload["batch"]
        parts: list[torch.Tensor] = payload["micro_batches"]
        if not parts:
            return [] if self._answers() else None
        micro = [batch.select(p) for p in parts]

        def loss_func(_index: int, _mb: Batch, lay: _Layout, logits: torch.Tensor) -> Any:
            lp = self._logprobs(logits, lay).detach()
            zero = lp.sum() * 0.0
            return zero, torch.tensor(lp.numel(), dtype=torch.int, device=lp.device), {"logprobs": lp.cpu()}

        self.model.eval()
        with torch.no_grad():
            results = self._run_schedule(micro, loss_func, forward_only=True)
        if not self._answers():
            return None
        out: list[torch.Tensor] = [torch.empty(0)] * batch.num_rows
        for part, mb, res in zip(parts, micro, results, strict=True):
            pieces = res["logprobs"].split(mb[C.RESPONSE_IDS].lengths.tolist())
            for row, piece in zip(part.tolist(), pieces, strict=True):
                out[row] = piece
        return out

    def op_train(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Forward/backward every micro-batch with Megatron's schedule, reduce gradients, one optimizer step."""
        batch: Batch = payload["batch"]
        parts: list[torch.Tensor] = payload["micro_batches"]
        ctx: LossContext = payload["ctx"]
        algorithm = rw.load_algorithm(payload["algorithm"])
        empty = not parts
        # a replica without rows still runs one pass (zero loss): the data-parallel gradient reduction is collective
        micro = [batch.select(p) for p in parts] if parts else [rw.EMPTY_PASS]
        stats = {"loss_sum": 0.0, "tokens": 0, "weighted": {}}

        def loss_func(_index: int, mb: Batch, lay: _Layout, logits: torch.Tensor) -> Any:
            lp = self._logprobs(logits, lay)
            if empty:
                loss = lp.sum() * 0.0
                n = 0
            else:
                loss, metrics = algorithm.loss(RaggedTensor(lp, lay.offsets.to(lp.device)), mb.to(lp.device), ctx)
                n = LossContext.count_tokens(mb)  # the tokens the loss applies to (loss_mask)
                stats["loss_sum"] += float(loss.detach())
                stats["tokens"] += n
                for name, value in metrics.items():
                    stats["weighted"][name] = stats["weighted"].get(name, 0.0) + float(value) * n
            return loss, torch.tensor(n, dtype=torch.int, device=lp.device), {"loss": loss.detach()}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(micro, loss_func, forward_only=False)
        stepped, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        stepped = bool(stepped) and bool(np.isfinite(norm))
        if not self._answers():
            stats = {"loss_sum": 0.0, "tokens": 0, "weighted": {}}
        return {**stats, "grad_norm": norm, "stepped": stepped, "answers": self._answers()}

    def _answers(self) -> bool:
        """Whether this rank reports its replica's results: the last pipeline stage, tensor-parallel rank 0."""
        return self.pp_rank == self.pp - 1 and self.tp_rank == 0

    # -- export -----------------------------------------------------------------

    def _full_megatron_names(self) -> list[tuple[str, int]]:
        """Every full Megatron parameter name with the stage that holds it, in Hugging Face export order."""
        assert self.arch is not None
        arch = self.arch
        names = [("embedding.word_embeddings.weight", 0)]
        in_norm, mlp_norm = hm._norm_names(self.impl == "transformer_engine")
        for i in range(arch.num_layers):
            stage = hm.stage_of(f"decoder.layers.{i}.x", arch, self.pp)
            suffixes = [in_norm, "self_attention.linear_qkv.weight"]
            suffixes += ["self_attention.linear_qkv.bias"] if arch.qkv_bias else []
            suffixes += (["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
                         if arch.qk_layernorm else [])
            suffixes += ["self_attention.linear_proj.weight", mlp_norm, "mlp.linear_fc1.weight",
                         "mlp.linear_fc2.weight"]
            names += [(f"decoder.layers.{i}.{s}", stage) for s in suffixes]
        names.append(("decoder.final_layernorm.weight", self.pp - 1))
        if not arch.tie_word_embeddings:
            names.append(("output_layer.weight", self.pp - 1))
        return names

    def op_export_plan(self, payload: dict[str, Any]) -> int:
        """Group the parameters into bucket-sized chunks; every rank makes the same plan from the architecture."""
        assert self.arch is not None
        bucket_bytes: int = payload["bucket_bytes"]
        itemsize = self._export_dtype().itemsize
        arch = self.arch
        sizes = ((name, sum(rw.aligned(n * itemsize) for n in _hf_numels(name, arch)))
                 for name, _stage in self._full_megatron_names())
        self._export_chunks = rw.plan_chunks(sizes, bucket_bytes)
        return len(self._export_chunks)

    def _local_param(self, full_name: str) -> torch.Tensor:
        assert self.arch is not None
        module = self.model.module
        local = hm.to_local_name(full_name, self.arch, self.pp)
        return dict(module.named_parameters())[local]

    def _gather_chunk(self, index: int) -> list[tuple[str, torch.Tensor]] | None:
        """Gather chunk ``index``: TP all-gather inside each stage, stage leaders send to rank 0, which renames.

        Returns the Hugging Face ``(name, tensor)`` pairs on rank 0, ``None`` elsewhere.
        """
        from megatron.core import parallel_state as ps

        assert self.arch is not None
        arch = self.arch
        dtype = self._export_dtype()
        stage_of = dict(self._full_megatron_names())
        tp_group = ps.get_tensor_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        leader = self.tp_rank == 0 and self.dp_rank == 0
        full: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name in self._export_chunks[index]:
                stage = stage_of[name]
                tensor: torch.Tensor | None = None
                if stage == self.pp_rank and self.dp_rank == 0:
                    local = self._local_param(name).detach().to(dtype).contiguous()
                    if self.tp > 1 and hm.tp_partition(name) != "replicated":
                        shards = [torch.empty_like(local) for _ in range(self.tp)]
                        dist.all_gather(shards, local, group=tp_group)
                        tensor = hm.merge_tp(name, shards, arch)
                    else:
                        tensor = hm.merge_tp(name, [local], arch)
                if self.pp > 1 and leader and stage != 0:
                    # the stage leaders (TP rank 0 of replica 0) ship full tensors to global rank 0
                    if self.pp_rank == stage:
                        assert tensor is not None
                        dist.send(tensor.contiguous(), dst=pp_ranks[0])
                    elif self.rank == 0:
                        tensor = torch.empty(_megatron_shape(name, arch), dtype=dtype, device=self.device)
                        dist.recv(tensor, src=pp_ranks[stage])
                if self.rank == 0:
                    assert tensor is not None
                    full.append((name, tensor))
        if self.rank != 0:
            return None
        te_names = self.impl == "transformer_engine"
        named: list[tuple[str, torch.Tensor]] = []
        for name, tensor in full:
            named += hm.megatron_to_hf({name: tensor}, arch, te_names=te_names).items()
        return named

    def op_export_chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Gather one chunk to rank 0, which packs it into buckets and hands them over in shared memory."""
        named = self._gather_chunk(payload["index"])
        if named is None:
            return None
        return self.ship_buckets(named, payload)

    def op_export_hf(self, payload: dict[str, Any]) -> None:
        """Every tensor gathered to rank 0 (as in export_weights), written as safetensors + config.json."""
        # one chunk per tensor keeps the peak at one gathered tensor beyond the state being written
        chunks = self.op_export_plan({"bucket_bytes": 1})
        state: dict[str, torch.Tensor] = {}
        for i in range(chunks):
            for name, tensor in self._gather_chunk(i) or []:
                state[name] = tensor.cpu().contiguous()
        self._export_chunks = []
        if self.rank == 0:
            from safetensors.torch import save_file

            path = Path(payload["path"])
            path.mkdir(parents=True, exist_ok=True)
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
            cfg = self._hf_config
            cfg.architectures = [_ARCHITECTURES[self.arch.model_type]]  # type: ignore[union-attr]
            cfg.dtype = str(self._export_dtype()).removeprefix("torch.")
            cfg.save_pretrained(str(path))
            self.copy_tokenizer(path)
        dist.barrier()

    # -- checkpoints ------------------------------------------------------------

    def _sharded_state(self, *, is_loading: bool = False) -> dict[str, Any]:
        # the GPTModel's own keys (the DDP wrapper would prefix them with "module.")
        return mc.sharded_state(self.model.module, self.optimizer, is_loading=is_loading)

    def op_save(self, payload: dict[str, Any]) -> None:
        """dist_checkpointing of model + optimizer (sharded, reshardable across TP/PP/DP), RNG per rank, meta file."""
        from megatron.core import dist_checkpointing

        path = Path(payload["path"])
        ckpt = path / "dist_ckpt"
        if self.rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        try:
            dist_checkpointing.save(self._sharded_state(), str(ckpt))
        finally:
            _stop_checkpoint_writer()
        self.finish_save(path, {
            "version": payload["version"], "world_size": self.world_size,
            "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
            "architecture": self.arch.model_type if self.arch else None,
            "megatron_names": "transformer_engine" if self.impl == "transformer_engine" else "local",
            "optimizer_format": mc.optimizer_format(self.config.use_distributed_optimizer)})

    def op_load(self, payload: dict[str, Any]) -> int:
        """Restore a checkpoint written by :meth:`op_save`; returns its version."""
        from megatron.core import dist_checkpointing

        path = Path(payload["path"])
        meta = self.read_meta(path)
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(path / "dist_ckpt"))
        # no autograd: the distributed optimizer copies into float32 main shards that are views of the parameters
        with torch.no_grad():
            self.model.module.load_state_dict(state["model"])
            steps = mc.checkpoint_steps(self.optimizer, state["optimizer"])
            self.optimizer.load_state_dict(state["optimizer"])
            mc.restore_torch_adam_steps(self.optimizer, steps)
        return self.finish_load(path, meta)

    # -- misc -------------------------------------------------------------------

    def close(self) -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
            except Exception:  # noqa: BLE001, S110 - tearing down; the driver reaps us anyway
                pass
        super().close()

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def _stop_checkpoint_writer() -> None:
    """Stop the helper process dist_checkpointing's file writer started for its results queue.

    megatron-core keeps it for the life of the rank; a rank that is killed (a
    failed command tears the group down) would leave it orphaned, so it is
    stopped after every save and started again by the next.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def _finalize_without_token_scaling(finalize: Any, model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    # reduce gradients over data-parallel ranks and pipeline-shared embeddings, but do not divide by the token
    # count: the algorithm's loss is normalised by the whole step (LossContext) already
    finalize(model, None, **kwargs)


def _megatron_shape(name: str, arch: hm.Architecture) -> tuple[int, ...]:
    """Shape of the full (TP-merged, unpadded) Megatron tensor ``name``."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    suffix = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (arch.vocab_size, h)
    if suffix == "self_attention.linear_qkv.weight":
        return ((arch.num_attention_heads + 2 * arch.num_query_groups) * d, h)
    if suffix == "self_attention.linear_qkv.bias":
        return ((arch.num_attention_heads + 2 * arch.num_query_groups) * d,)
    if suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return (d,)
    if suffix == "self_attention.linear_proj.weight":
        return (h, arch.num_attention_heads * d)
    if suffix == "mlp.linear_fc1.weight":
        return (2 * f, h)
    if suffix == "mlp.linear_fc2.weight":
        return (h, f)
    return (h,)  # the norms


def _hf_numels(name: str, arch: hm.Architecture) -> list[int]:
    """Element counts of the Hugging Face tensors the full Megatron tensor ``name`` becomes (qkv: 3, fc1: 2)."""
    d, h = arch.kv_channels, arch.hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    if name.endswith("self_attention.linear_qkv.weight"):
        return [q * h, kv * h, kv * h]
    if name.endswith("self_attention.linear_qkv.bias"):
        return [q, kv, kv]
    if name.endswith("mlp.linear_fc1.weight"):
        return [arch.ffn_hidden_size * h] * 2
    return [int(np.prod(_megatron_shape(name, arch)))]
