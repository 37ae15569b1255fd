"""The rank side: one process per rank, serving the driver's commands over a pipe.

A rank owns its shard of the model and optimizer. The driver
(:class:`asyncflow_fsdp.engine.FSDPTrainEngine`) sends every rank the same
command, with that rank's share of the rows; every rank then runs the same
collectives in the same order (FSDP all-gathers and reduce-scatters, the
gradient-norm all-reduce, the export gathers, DCP's plan exchange) and
answers. Messages are ``pickle`` over a private ``multiprocessing`` pipe
between the driver and the processes it started.

This module is imported by the forkserver before it forks ranks, so heavy
imports live at the top on purpose.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import shutil
import socket
import traceback
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
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
from asyncflow_core.types import Batch, RaggedTensor, pack_buckets
from asyncflow_core.types.weights import BUCKET_ALIGNMENT
from asyncflow_fsdp.config import FSDPTrainConfig
from asyncflow_fsdp.devices import rank_device
from asyncflow_fsdp.forward import layout, score
from asyncflow_fsdp.init import materialize_from_rank0, meta_skeleton
from asyncflow_plugins.hf.model import DTYPES, build_causal_lm

CHECKPOINT_FORMAT = "asyncflow-fsdp/1"
META_FILE = "asyncflow_fsdp.json"  #: written last by save(): its presence marks a complete checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


def rank_main(rank: int, world_size: int, conn: Any, options: dict[str, Any]) -> None:
    """Entry point of a rank process: answer commands until ``shutdown`` or until the driver goes away."""
    worker = RankWorker(rank, world_size, FSDPTrainConfig.model_validate(options))
    try:
        while True:
            try:
                op, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone: nothing left to serve
            if op == "shutdown":
                worker.close()
                conn.send_bytes(pickle.dumps(("ok", None)))
                return
            try:
                result = getattr(worker, f"op_{op}")(payload)
                reply = ("ok", result)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver with its reason
                reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
            conn.send_bytes(pickle.dumps(reply))
    finally:
        worker.close()


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


class RankWorker:
    """State of one rank: process group, sharded model (+ value head), optimizer."""

    def __init__(self, rank: int, world_size: int, config: FSDPTrainConfig) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.device = torch.device("cpu")
        self._listen_fd: int | None = None
        self.model: torch.nn.Module | None = None
        self.value_head: torch.nn.Module | None = None
        self.holder: torch.nn.ModuleDict | None = None  # both modules, for state dicts
        self.optimizer: torch.optim.Optimizer | None = None
        self._fsdp: list[FSDPModule] = []
        self._keep_logits = True
        self._architecture = ""
        self._export_chunks: list[list[tuple[str, torch.Tensor]]] = []

    # -- start ------------------------------------------------------------------

    def op_bind(self, _payload: Any) -> int | None:
        """Rank 0 binds the rendezvous socket on 127.0.0.1 (a free port, no race) and says which port."""
        if self.rank != 0:
            return None
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # the TCPStore polls this fd for the life of the process: detach so Python never closes it under the store
        self._listen_fd = listener.detach()
        return port

    def op_setup(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Join the group (rendezvous on loopback only), build and shard the model, make the optimizer."""
        c = self.config
        device_type: str = payload["device"]
        if c.cpu_threads_per_rank or device_type == "cpu":
            torch.set_num_threads(c.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // self.world_size))
        lo = _loopback_interface()
        if lo is not None:  # gloo's and NCCL's own sockets on loopback too, not only the rendezvous
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        timeout = timedelta(seconds=c.timeout_s)
        port = int(payload["port"])
        if self.rank == 0:
            store = dist.TCPStore("127.0.0.1", port, self.world_size, True, timeout=timeout,
                                  master_listen_fd=self._listen_fd, use_libuv=False)
        else:
            store = dist.TCPStore("127.0.0.1", port, self.world_size, False, timeout=timeout, use_libuv=False)
        if device_type == "cuda":
            self.device = rank_device(self.rank, torch.cuda.device_count())
            torch.cuda.set_device(self.device)  # before anything allocates on CUDA (NCCL's communicator too)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        torch.manual_seed(c.seed + self.rank)

        if c.model is None:
            raise ValueError("no model: set the run's `model` section or the engine's `model` option")
        # rank 0 alone builds the real model (from the checkpoint or the seed) on the CPU; every rank shards an
        # empty float32 skeleton (the master weights; the compute dtype is the mixed-precision policy's) and then
        # receives its slices from rank 0: no rank holds the whole model on its device, only rank 0 in CPU memory
        source = build_causal_lm(c.model, seed=c.seed, device="cpu") if self.rank == 0 else None
        net = meta_skeleton(c.model)
        self._architecture = type(net).__name__
        self._keep_logits = "logits_to_keep" in inspect.signature(net.forward).parameters
        if c.gradient_checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mesh = init_device_mesh(device_type, (self.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": c.reshard_after_forward}
        if device_type == "cuda" and c.mixed_precision == "bfloat16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blocks = _decoder_blocks(net)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(net, **kwargs)
        materialize_from_rank0(net, source, self.device)
        del source
        self.model = net
        self._fsdp = [m for m in net.modules() if isinstance(m, FSDPModule)]
        modules: dict[str, torch.nn.Module] = {"policy": net}
        if c.value_head:
            head = torch.nn.Linear(net.config.hidden_size, 1, device=self.device)
            torch.nn.init.zeros_(head.weight)  # identical on every rank, and values start at 0
            torch.nn.init.zeros_(head.bias)
            fully_shard(head, **kwargs)
            self.value_head = head
            self._fsdp.append(head)  # type: ignore[arg-type]
            modules["value_head"] = head
        self.holder = torch.nn.ModuleDict(modules)
        self.optimizer = torch.optim.AdamW(
            self.holder.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay
        )
        return {
            "vocab_size": int(net.get_input_embeddings().weight.shape[0]),
            "parameters": sum(p.numel() for p in net.parameters()),
            "device": str(self.device),
            "backend": backend,
            "sharded_blocks": len(blocks),
            "architecture": self._architecture,
        }

    # -- forward / train --------------------------------------------------------

    def _score(self, mb: Batch, *, with_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        c = self.config
        assert self.model is not None
        return score(
            self.model, layout(mb["prompt_ids"], mb["response_ids"]), device=self.device,
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
                    self._score(_EMPTY_PASS, with_values=want_values)  # keep this rank in step with the others
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
        try:
            algorithm = pickle.loads(payload["algorithm"])
        except Exception as exc:
            raise ValueError(f"the algorithm could not be rebuilt in the rank process ({exc}); define its class "
                             "in an importable module (ranks re-import the driver's __main__ as multiprocessing's "
                             "spawn does, so guard scripts with `if __name__ == '__main__':`)") from exc
        value_loss = getattr(algorithm, "value_loss", None) if self.value_head is not None else None
        # algorithms that read `values` (PPO) find the head's predictions, with grad, in `value_preds`
        value_preds = (self.value_head is not None and value_loss is None
                       and C.VALUES in tuple(getattr(algorithm, "required_columns", ())))
        want_values = value_loss is not None or value_preds
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0
        weighted: dict[str, float] = {}
        for k in range(payload["passes"]):
            if k < len(parts):
                mb = batch.select(parts[k])
                offsets = mb["response_ids"].offsets
                lp, v = self._score(mb, with_values=want_values)
                if value_preds:
                    mb = mb.with_columns(**{C.VALUE_PREDS: RaggedTensor(v, offsets)})
                loss, metrics = algorithm.loss(RaggedTensor(lp, offsets), mb, ctx)
                if value_loss is not None:
                    vloss, vmetrics = value_loss(RaggedTensor(v, offsets), mb, ctx)
                    loss = loss + vloss
                    metrics = {**metrics, "value_loss": float(vloss.detach()), **vmetrics}
                n = int(lp.numel())
                tokens += n
                loss_sum += float(loss.detach())
                for name, value in metrics.items():
                    weighted[name] = weighted.get(name, 0.0) + float(value) * n
            else:  # an empty pass: same collectives, zero gradient
                lp, v = self._score(_EMPTY_PASS, with_values=want_values)
                loss = lp.sum() * 0.0 + (v.sum() * 0.0 if v is not None else 0.0)
            # FSDP averages gradients over ranks; the losses are already normalised by the whole step's
            # counts (LossContext), so the full-batch gradient is the *sum* over ranks: undo the average.
            (loss * self.world_size).backward()
        params = [p for p in self.holder.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        norm = float(grad_norm)
        stepped = bool(np.isfinite(norm))
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": loss_sum, "tokens": tokens, "weighted": weighted, "grad_norm": norm,
                "stepped": stepped, "micro_batches": len(parts)}

    # -- export -----------------------------------------------------------------

    def _export_dtype(self) -> torch.dtype:
        c = self.config
        name = c.export_dtype if c.export_dtype != "auto" else (c.model.dtype if c.model else "float32")
        return DTYPES[name]

    def op_export_plan(self, payload: dict[str, Any]) -> int:
        """Group the HF-named tensors into buckets (same rule as ``pack_buckets``); every rank makes the same plan."""
        assert self.model is not None
        self._reshard()
        bucket_bytes: int = payload["bucket_bytes"]
        dtype = self._export_dtype()
        chunks: list[list[tuple[str, torch.Tensor]]] = []
        current: list[tuple[str, torch.Tensor]] = []
        size = 0
        seen: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # tied weights (e.g. lm_head = embed_tokens): export the first name only
                continue
            seen.add(id(tensor))
            itemsize = dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
            nbytes = _align(tensor.numel() * itemsize)
            if current and size + nbytes > bucket_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += nbytes
        chunks.append(current)
        self._export_chunks = chunks
        return len(chunks)

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
        out = []
        for bucket in pack_buckets(full, version=payload["version"], bucket_bytes=payload["bucket_bytes"]):
            out.append({"metas": bucket.metas, "checksum": bucket.checksum, "nbytes": bucket.nbytes,
                        "shm": _to_shared_memory(bucket.buffer)})
        return out

    def op_export_done(self, _payload: Any) -> None:
        self._export_chunks = []

    # -- checkpoints ------------------------------------------------------------

    def op_save(self, payload: dict[str, Any]) -> None:
        """DCP checkpoint of model + optimizer (sharded, reshardable), RNG per rank, then the meta file."""
        assert self.holder is not None and self.optimizer is not None
        self._reshard()
        path = Path(payload["path"])
        model_sd, optim_sd = get_state_dict(self.holder, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, path / f"rng_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            meta = {"format": CHECKPOINT_FORMAT, "version": payload["version"], "world_size": self.world_size,
                    "value_head": self.value_head is not None, "architecture": self._architecture}
            tmp = path / (META_FILE + ".tmp")
            tmp.write_text(json.dumps(meta, indent=2))
            tmp.replace(path / META_FILE)
        dist.barrier()

    def op_load(self, payload: dict[str, Any]) -> int:
        """Restore a checkpoint written by :meth:`op_save` (any world size); returns its version."""
        assert self.holder is not None and self.optimizer is not None
        path = Path(payload["path"])
        meta = json.loads((path / META_FILE).read_text())
        if bool(meta.get("value_head")) != (self.value_head is not None):
            raise ValueError(f"checkpoint {path} was saved with value_head={meta.get('value_head')}, this engine has "
                             f"value_head={self.value_head is not None}; use the same option")
        self._reshard()
        model_sd, optim_sd = get_state_dict(self.holder, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.holder, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if meta.get("world_size") == self.world_size and rng_file.exists():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        dist.barrier()
        return int(meta["version"])

    def op_export_hf(self, payload: dict[str, Any]) -> None:
        """Full state dict to rank 0 (CPU), written with ``save_pretrained`` in the export dtype."""
        assert self.model is not None
        self._reshard()
        path = Path(payload["path"])
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
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
            source = self.config.model.path if self.config.model else None
            if source:  # keep the tokenizer next to the weights so the directory is a complete checkpoint
                for name in TOKENIZER_FILES:
                    if (Path(source) / name).is_file():
                        shutil.copy2(Path(source) / name, path / name)
        dist.barrier()

    # -- misc -------------------------------------------------------------------

    def op_ping(self, _payload: Any) -> int:
        return os.getpid()

    def _reshard(self) -> None:
        # with reshard_after_forward=False a forward-only pass leaves parameters gathered: free them
        for module in self._fsdp:
            module.reshard()

    def close(self) -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - tearing down; the driver reaps us anyway
                pass


_EMPTY_PASS = Batch({"prompt_ids": RaggedTensor.from_sequences([[0]]),
                     "response_ids": RaggedTensor.from_sequences([[0]])})


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


def _align(n: int) -> int:
    return (n + BUCKET_ALIGNMENT - 1) // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT


def _to_shared_memory(buffer: torch.Tensor) -> str:
    """Copy a bucket buffer into a new shared-memory segment; the driver copies it out and unlinks it."""
    n = buffer.numel()
    shm = shared_memory.SharedMemory(create=True, size=max(n, 1))
    # the driver owns the segment from here on (it unlinks it): keep this process's tracker from unlinking it too
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    view = np.ndarray((n,), dtype=np.uint8, buffer=shm.buf)
    view[:] = buffer.detach().cpu().numpy()
    del view
    name = shm.name
    shm.close()
    return name
