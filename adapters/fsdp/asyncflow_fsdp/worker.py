"""The rank side: one process per rank, serving the driver's commands over a pipe.

A rank owns its shard of the model and optimizer. The driver
(:class:`asyncflow_fsdp.engine.FSDPTrainEngine`) sends every rank the same
command, with that rank's share of the rows; every rank then runs the same
collectives in the same order (FSDP all-gathers and reduce-scatters, the
gradient-norm all-reduce, the export gathers, DCP's plan exchange) and
answers. The protocol (pipe, rendezvous, shared-memory export, checkpoint
frame) is the core's :mod:`asyncflow_core.launchers.rank_worker`; this
module holds what FSDP does.

This module is imported by the forkserver before it forks ranks, so heavy
imports live at the top on purpose.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers.modeling_utils  # noqa: F401  (imported here so the forkserver pays for it once)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM  # noqa: F401  (resolves the lazy auto-model module in the forkserver)

from asyncflow_core import columns as C
from asyncflow_core.interfaces import LossContext
from asyncflow_core.launchers.rank_worker import (
    EMPTY_PASS,
    RankWorkerBase,
    aligned,
    load_algorithm,
    plan_chunks,
    rank_device,
    serve,
)
from asyncflow_core.types import Batch, RaggedTensor
from asyncflow_core.types.adapter import adapter_state_dict, wrap
from asyncflow_fsdp.config import FSDPTrainConfig
from asyncflow_fsdp.forward import PromptSharing, layout, prompt_sharing, score
from asyncflow_fsdp.init import materialize_from_rank0, meta_skeleton
from asyncflow_plugins.hf.model import build_causal_lm


def rank_main(rank: int, world_size: int, conn: Any, options: dict[str, Any]) -> None:
    """Entry point of a rank process: answer commands until ``shutdown`` or until the driver goes away."""
    serve(RankWorker(rank, world_size, FSDPTrainConfig.model_validate(options)), conn)


class RankWorker(RankWorkerBase):
    """State of one rank: process group, sharded model (+ value head), optimizer."""

    engine_name = "fsdp"
    config: FSDPTrainConfig

    def __init__(self, rank: int, world_size: int, config: FSDPTrainConfig) -> None:
        super().__init__(rank, world_size, config)
        self.model: torch.nn.Module | None = None
        self.value_head: torch.nn.Module | None = None
        self.holder: torch.nn.ModuleDict | None = None  # both modules, for state dicts
        self.optimizer: torch.optim.Optimizer | None = None
        self._fsdp: list[FSDPModule] = []
        self._keep_logits = True
        self._sharing: PromptSharing | None = None  # shared-prompt layouts (forward.layout); None: never
        self._architecture = ""
        self._export_chunks: list[list[tuple[str, torch.Tensor]]] = []
        self._version = 0  # optimizer steps taken (the driver's version): export sends the adapter only after 0

    # -- start ------------------------------------------------------------------

    def op_setup(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Join the group (rendezvous on loopback only), build and shard the model, make the optimizer."""
        c = self.config
        device_type: str = payload["device"]
        if c.cpu_threads_per_rank or device_type == "cpu":
            # the driver's process keeps a share: in one_step and async runs the rollout engine there generates
            # while the ranks train, and torch's threads on an oversubscribed core wait on each other
            self.set_cpu_threads(others=1)
        if device_type == "cuda":
            self.device = rank_device(self.rank, torch.cuda.device_count())
            torch.cuda.set_device(self.device)  # before anything allocates on CUDA (NCCL's communicator too)
            backend = "nccl"
        else:
            backend = "gloo"
        self.join_group(int(payload["port"]), backend)
        torch.manual_seed(c.seed + self.rank)

        if c.model is None:
            raise ValueError("no model: set the run's `model` section or the engine's `model` option")
        sharded = c.sharded(device_type)
        if not sharded and device_type == "cuda" and c.mixed_precision == "bfloat16":
            raise ValueError("shard: never has no bf16 compute on the GPU (FSDP2's MixedPrecisionPolicy supplies "
                             "it); set mixed_precision: float32, or shard: auto")
        # rank 0 alone builds the real model (from the checkpoint or the seed) on the CPU
        source = build_causal_lm(c.model, seed=c.seed, device="cpu") if self.rank == 0 else None
        blocks: list[torch.nn.Module] = []
        kwargs: dict[str, Any] = {}
        if sharded:
            # every rank shards an empty float32 skeleton (the master weights; the compute dtype is the
            # mixed-precision policy's) and then receives its slices from rank 0: no rank holds the whole model on
            # its device, only rank 0 in CPU memory
            net = meta_skeleton(c.model)
        else:
            # one rank, no FSDP: the source itself becomes the model (made float32 below: the same weights the
            # skeleton would receive, tied embeddings still one parameter), with plain parameters of the same
            # names, so checkpoints hold the same tensors (DCP reshards plain tensors and DTensors alike) and load
            # at any world size
            assert source is not None
            net, source = source, None
        self._architecture = type(net).__name__
        self._keep_logits = "logits_to_keep" in inspect.signature(net.forward).parameters
        self._sharing = prompt_sharing(net) if c.share_prompts else None
        if c.gradient_checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if c.lora is not None:
            # peft wraps before fully_shard: the base is frozen (requires_grad=False) and each block's adapter
            # weights share its FSDP unit (FSDP2 keeps every parameter separate, so frozen and trainable mix).
            # Rank 0 draws the adapter's initial A from the seed (B starts at 0, so version 0 is the base model)
            # and, sharded, broadcasts it with the rest.
            if sharded:
                net = wrap(net, c.lora)
            with torch.random.fork_rng():
                torch.manual_seed(c.seed)
                if not sharded:
                    net = wrap(net, c.lora)
                elif source is not None:
                    source = wrap(source, c.lora)
        if sharded:
            mesh = init_device_mesh(device_type, (self.world_size,))
            kwargs = {"mesh": mesh, "reshard_after_forward": c.reshard_after_forward}
            if device_type == "cuda" and c.mixed_precision == "bfloat16":
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            blocks = _decoder_blocks(net.get_base_model() if c.lora is not None else net)
            for block in blocks:
                fully_shard(block, **kwargs)
            fully_shard(net, **kwargs)
            materialize_from_rank0(net, source, self.device)
            del source
        else:
            net = net.float().to(self.device)  # in place (tied parameters stay tied), as materialize casts
        self.model = net
        self._fsdp = [m for m in net.modules() if isinstance(m, FSDPModule)]
        modules: dict[str, torch.nn.Module] = {"policy": net}
        if c.value_head:
            head = torch.nn.Linear(net.config.hidden_size, 1, device=self.device)
            torch.nn.init.zeros_(head.weight)  # identical on every rank, and values start at 0
            torch.nn.init.zeros_(head.bias)
            if sharded:
                fully_shard(head, **kwargs)
                self._fsdp.append(head)  # type: ignore[arg-type]
            self.value_head = head
            modules["value_head"] = head
        self.holder = torch.nn.ModuleDict(modules)
        self.holder.eval()  # peft's new modules (lora dropout) start in training mode; log-probs never drop
        trainable = [p for p in self.holder.parameters() if p.requires_grad]  # with LoRA: the adapter (+ head)
        self.optimizer = torch.optim.AdamW(trainable, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
        return {
            "vocab_size": int(net.get_input_embeddings().weight.shape[0]),
            "parameters": sum(p.numel() for p in net.parameters()),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "device": str(self.device),
            "backend": backend,
            "sharded": sharded,
            "sharded_blocks": len(blocks),
            "architecture": self._architecture,
        }

    # -- forward / train --------------------------------------------------------

    def _score(self, mb: Batch, *, with_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        c = self.config
        assert self.model is not None
        return score(
            self.model, layout(mb["prompt_ids"], mb["response_ids"], sharing=self._sharing),
            device=self.device,
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
            value_head=self.value_head if with_values else None, keep_logits_supported=self._keep_logits,
        )

    def op_logprobs(self, payload: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-row log-probs (and values) of this rank's rows, in row order."""
        batch: Batch = payload["batch"]
        parts: list[torch.Tensor] = payload["micro_batches"]
        want_values: bool = payload["values"]
        rows = batch.num_rows
        logps: list[torch.Tensor] = [torch.empty(0)] * rows
        vals: list[torch.Tensor] = [torch.empty(0)] * rows
        with torch.no_grad():
            for k in range(payload["passes"]):
                if k >= len(parts):
                    self._score(EMPTY_PASS, with_values=want_values)  # keep this rank in step with the others
                    continue
                mb = batch.select(parts[k])
                lp, v = self._score(mb, with_values=want_values)
                lengths = mb["response_ids"].lengths.tolist()
                for row, piece in zip(parts[k].tolist(), lp.cpu().split(lengths), strict=True):
                    logps[row] = piece
                if v is not None:
                    for row, piece in zip(parts[k].tolist(), v.cpu().split(lengths), strict=True):
                        vals[row] = piece
        self._reshard()
        return logps, (vals if want_values else None)

    def op_train(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Forward/backward every micro-batch, clip the global gradient norm, one AdamW step."""
        assert self.optimizer is not None and self.holder is not None
        batch: Batch = payload["batch"]
        parts: list[torch.Tensor] = payload["micro_batches"]
        ctx: LossContext = payload["ctx"]
        algorithm = load_algorithm(payload["algorithm"])
        value_loss = getattr(algorithm, "value_loss", None) if self.value_head is not None else None
        # algorithms that read `values` (PPO) find the head's predictions, with grad, in `value_preds`
        value_preds = (self.value_head is not None and value_loss is None
                       and C.VALUES in tuple(getattr(algorithm, "required_columns", ())))
        want_values = value_loss is not None or value_preds
        self.optimizer.zero_grad(set_to_none=True)
        weighted: dict[str, float] = {}
        dropout = self.config.lora is not None and self.config.lora.dropout > 0
        if dropout:  # the adapter's dropout acts in train steps only; log-probs are always computed in eval mode
            self.holder.train()
        try:
            loss_sum, tokens = self._passes(payload["passes"], batch, parts, ctx, algorithm, value_loss, value_preds,
                                            want_values, weighted)
        finally:
            if dropout:
                self.holder.eval()
        params = [p for p in self.holder.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        norm = float(grad_norm)
        stepped = bool(np.isfinite(norm))
        if stepped:
            self.optimizer.step()
            self._version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": loss_sum, "tokens": tokens, "weighted": weighted, "grad_norm": norm,
                "stepped": stepped, "micro_batches": len(parts)}

    def _passes(self, passes: int, batch: Batch, parts: list[torch.Tensor], ctx: LossContext, algorithm: Any,
                value_loss: Any, value_preds: bool, want_values: bool,
                weighted: dict[str, float]) -> tuple[float, int]:
        """Forward/backward of every pass of a train step (gradients accumulate); the loss sum and token count."""
        loss_sum, tokens = 0.0, 0
        for k in range(passes):
            if k < len(parts):
                mb = batch.select(parts[k])
                offsets = mb["response_ids"].offsets
                lp, v = self._score(mb, with_values=want_values)
                # the loss combines the micro-batch's columns with the log-probs on the rank's device
                mb, offsets = mb.to(lp.device), offsets.to(lp.device)
                if value_preds:
                    mb = mb.with_columns(**{C.VALUE_PREDS: RaggedTensor(v, offsets)})
                loss, metrics = algorithm.loss(RaggedTensor(lp, offsets), mb, ctx)
                if value_loss is not None:
                    vloss, vmetrics = value_loss(RaggedTensor(v, offsets), mb, ctx)
                    loss = loss + vloss
                    metrics = {**metrics, "value_loss": float(vloss.detach()), **vmetrics}
                n = LossContext.count_tokens(mb)  # the tokens the loss applies to (loss_mask)
                tokens += n
                loss_sum += float(loss.detach())
                for name, value in metrics.items():
                    weighted[name] = weighted.get(name, 0.0) + float(value) * n
            else:  # an empty pass: same collectives, zero gradient
                lp, v = self._score(EMPTY_PASS, with_values=want_values)
                loss = lp.sum() * 0.0 + (v.sum() * 0.0 if v is not None else 0.0)
            # FSDP averages gradients over ranks; the losses are already normalised by the whole step's
            # counts (LossContext), so the full-batch gradient is the *sum* over ranks: undo the average.
            (loss * self.world_size).backward()
        return loss_sum, tokens

    # -- export -----------------------------------------------------------------

    def op_export_plan(self, payload: dict[str, Any]) -> int:
        """Group the HF-named tensors into buckets (same rule as ``pack_buckets``); every rank makes the same plan."""
        assert self.model is not None
        self._reshard()
        bucket_bytes: int = payload["bucket_bytes"]
        dtype = self._export_dtype()
        items: list[tuple[tuple[str, torch.Tensor], int]] = []
        seen: set[int] = set()
        for name, tensor in self._exported():
            if id(tensor) in seen:  # tied weights (e.g. lm_head = embed_tokens): export the first name only
                continue
            seen.add(id(tensor))
            itemsize = dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
            items.append(((name, tensor), aligned(tensor.numel() * itemsize)))
        self._export_chunks = plan_chunks(items, bucket_bytes)
        return len(self._export_chunks)

    def _exported(self) -> list[tuple[str, torch.Tensor]]:
        """What ``export_weights`` sends: every tensor by its Hugging Face name, or with LoRA after version 0 only
        the adapter's (``peft.get_peft_model_state_dict`` names, e.g. ``...q_proj.lora_A.weight``)."""
        assert self.model is not None
        state = self.model.state_dict(keep_vars=True)
        if self.config.lora is None:
            return list(state.items())
        if self._version > 0:
            return list(adapter_state_dict(self.model, state_dict=state).items())
        # version 0: the base model (B = 0, so the adapter adds nothing yet) under the plain model's names
        return [(hf, tensor) for name, tensor in state.items() if (hf := base_name(name)) is not None]

    def op_export_chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Gather one bucket's tensors (cast first, so the gather moves export-dtype bytes); rank 0 ships them."""
        dtype = self._export_dtype()
        full: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, tensor in self._export_chunks[payload["index"]]:
                t = tensor.detach()
                if t.is_floating_point():
                    t = t.to(dtype)
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                full.append((name, t))
        if self.rank != 0:
            return None
        return self.ship_buckets(full, payload)

    # -- checkpoints ------------------------------------------------------------

    def op_save(self, payload: dict[str, Any]) -> None:
        """DCP checkpoint of model + optimizer (sharded, reshardable), RNG per rank, then the meta file."""
        assert self.holder is not None and self.optimizer is not None
        self._reshard()
        path = Path(payload["path"])
        model_sd, optim_sd = get_state_dict(self.holder, self.optimizer, options=self._state_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        lora = self.config.lora.model_dump(mode="json") if self.config.lora is not None else None
        self.finish_save(path, {"version": payload["version"], "world_size": self.world_size,
                                "value_head": self.value_head is not None, "architecture": self._architecture,
                                "lora": lora})

    def op_load(self, payload: dict[str, Any]) -> int:
        """Restore a checkpoint written by :meth:`op_save` (any world size); returns its version."""
        assert self.holder is not None and self.optimizer is not None
        path = Path(payload["path"])
        meta = self.read_meta(path)
        if bool(meta.get("value_head")) != (self.value_head is not None):
            raise ValueError(f"checkpoint {path} was saved with value_head={meta.get('value_head')}, this engine has "
                             f"value_head={self.value_head is not None}; use the same option")
        mine = self.config.lora.model_dump(mode="json") if self.config.lora is not None else None
        if _adapter_shape(meta.get("lora")) != _adapter_shape(mine):
            raise ValueError(f"checkpoint {path} was saved with trainer.lora={meta.get('lora')}, this engine has "
                             f"trainer.lora={mine}; use the same rank, alpha, target_modules and modules_to_save")
        self._reshard()
        options = self._state_options()
        model_sd, optim_sd = get_state_dict(self.holder, self.optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.holder, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        self._version = self.finish_load(path, meta)
        return self._version

    def _state_options(self) -> StateDictOptions | None:
        # with LoRA a checkpoint holds what trains (adapter, modules_to_save, value head) and its optimizer state;
        # the frozen base comes back from model.path / the seed at setup. DCP still refuses a checkpoint that
        # lacks any trainable tensor (every requested key must be found).
        if self.config.lora is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def op_export_hf(self, payload: dict[str, Any]) -> None:
        """Full state dict to rank 0 (CPU), written with ``save_pretrained`` in the export dtype."""
        assert self.model is not None
        self._reshard()
        path = Path(payload["path"])
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.config.lora is not None:
            if self.rank == 0:
                self._export_lora(path, state)
            dist.barrier()
            return
        if self.rank == 0:
            dtype = self._export_dtype()
            state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path), state_dict=state)
            # the FSDP-wrapped class would be recorded as the architecture: write the model's own, and the dtype
            config_file = path / "config.json"
            config = json.loads(config_file.read_text())
            config["architectures"] = [self._architecture]
            config["dtype"] = str(dtype).removeprefix("torch.")
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            self.copy_tokenizer(path)
        dist.barrier()

    def _export_lora(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """Rank 0: a CPU copy of the peft model from the gathered ``state``; the merged model or the adapter."""
        c = self.config
        assert c.lora is not None and c.model is not None
        copy = wrap(meta_skeleton(c.model), c.lora)  # shapes only: the gathered tensors are assigned, not copied
        copy.load_state_dict(state, assign=True)
        dtype = self._export_dtype()
        path.mkdir(parents=True, exist_ok=True)
        if c.lora.export == "adapter":
            # PeftModel.save_pretrained picks the adapter's tensors out of the state dict it is given
            copy.peft_config["default"].base_model_name_or_path = c.model.path
            cast = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in copy.state_dict().items()}
            copy.save_pretrained(str(path), state_dict=cast)
            self.copy_tokenizer(path)
            return
        merged = copy.merge_and_unload()  # W + (alpha / r) B A, folded into the base layers by peft
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in merged.state_dict().items()}
        merged.save_pretrained(str(path), state_dict=out)
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config["architectures"] = [self._architecture]
        config["dtype"] = str(dtype).removeprefix("torch.")
        embed, head = merged.get_input_embeddings(), merged.get_output_embeddings()
        if config.get("tie_word_embeddings") and head is not None and not torch.equal(embed.weight, head.weight):
            config["tie_word_embeddings"] = False  # modules_to_save trained one of them: keep both as trained
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        self.copy_tokenizer(path)

    # -- misc -------------------------------------------------------------------

    def _reshard(self) -> None:
        # with reshard_after_forward=False a forward-only pass leaves parameters gathered: free them
        for module in self._fsdp:
            module.reshard()



def base_name(name: str) -> str | None:
    """The plain model's name of a peft model's tensor (``None`` for the adapter's own tensors)."""
    if ".lora_" in name or ".modules_to_save." in name:
        return None
    return (name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            .replace(".original_module.", "."))


def _adapter_shape(lora: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What a checkpoint's adapter must share with the engine's (dropout and export may differ)."""
    if lora is None:
        return None
    return (lora.get("rank"), lora.get("alpha"), tuple(lora.get("target_modules") or ()),
            tuple(lora.get("modules_to_save") or ()))


def _decoder_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (each becomes one FSDP unit): ``layers`` / ``h`` / ``blocks`` of the decoder."""
    decoder = net.get_decoder() if hasattr(net, "get_decoder") else net
    for name in ("layers", "h", "blocks"):
        blocks = getattr(decoder, name, None)
        if isinstance(blocks, torch.nn.ModuleList):
            return list(blocks)
    for module in net.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    return []
