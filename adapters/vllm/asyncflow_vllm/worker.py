"""The worker extension: runs inside each vLLM worker process and loads broadcast weight buckets.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine
reaches its methods with ``AsyncLLM.collective_rpc``. The weight group is a
torch.distributed group of its own, built from a ``TCPStore`` on 127.0.0.1
(rank 0: the engine's process, which sends; ranks 1..N: the workers), so it
never touches vLLM's own process groups.

Protocol of one update (the engine announces before anyone receives, so no
receive is ever posted for a transfer that is not coming: a gloo receive that
times out poisons its connection):

1. the engine calls ``asyncflow_load(version, buckets)`` through
   ``collective_rpc`` with every bucket's metadata (name, dtype, shape and
   byte offset of each tensor, the bucket's size and BLAKE2b digest), then
   broadcasts the buckets' byte buffers in order;
2. each worker receives bucket i+1 into the other of two buffers while it
   checks bucket i's digest and hands copies of its tensors to
   ``model.load_weights`` (double buffering), inside vLLM's layerwise-reload
   session when the installed vLLM has one, so post-load processing
   (repacking for CPU kernels, quantisation) is redone. The copies matter:
   that session holds a layer's tensors until the whole layer has arrived,
   and a fused parameter (q/k/v, gate/up) may span two buckets;
3. with ``verify`` on, every parameter of the vLLM model is read back and
   compared with the tensors sent (fused q/k/v and gate/up included).

A tied tensor the sender sent under one name (trainers export
``model.embed_tokens.weight`` but not ``lm_head.weight``) is loaded under its
other names as well (``aliases``): vLLM's CPU backend keeps a repacked copy of
the output projection that only a load by that name refreshes.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def _digest(buffer: torch.Tensor) -> str:
    data = buffer if buffer.device.type == "cpu" else buffer.cpu()
    return hashlib.blake2b(memoryview(data.numpy()), digest_size=16).hexdigest()


def _views(buffer: torch.Tensor, metas: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for m in metas:
        dtype = _DTYPES[m["dtype"]]
        nbytes = int(torch.Size(m["shape"]).numel()) * dtype.itemsize
        out.append((m["name"], buffer[m["offset"] : m["offset"] + nbytes].view(dtype).view(m["shape"])))
    return out


class WeightSyncExtension:
    """Methods vLLM adds to its worker; called by the ``vllm`` engine through ``collective_rpc``."""

    def asyncflow_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        """Join the weight group as rank 1 + this worker's rank; returns that rank."""
        from torch.distributed import TCPStore

        rank = 1 + int(self.rank)
        store = TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            group = ProcessGroupNCCL(store, rank, world_size, ProcessGroupNCCL.Options())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            group = loopback_gloo_group(store, rank, world_size, timeout)
            device = torch.device("cpu")
        self._asyncflow_group = group
        self._asyncflow_store = store
        self._asyncflow_device = device
        return rank

    def asyncflow_leave(self) -> None:
        """Drop the weight group (the engine is shutting down or rebuilding it)."""
        self._asyncflow_group = None
        self._asyncflow_store = None

    def asyncflow_load(
        self, version: int, buckets: list[dict[str, Any]], verify: bool, aliases: dict[str, list[str]] | None = None
    ) -> dict[str, Any]:
        """Receive ``buckets`` by broadcast from rank 0 and load them; see the module docstring."""
        group = getattr(self, "_asyncflow_group", None)
        if group is None:
            raise RuntimeError("asyncflow_load before asyncflow_join: the weight group is not set up")
        device = self._asyncflow_device
        model = self.model_runner.model
        largest = max(int(b["nbytes"]) for b in buckets)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(2, len(buckets)))]

        def post(i: int) -> Any:
            target = buffers[i % len(buffers)][: int(buckets[i]["nbytes"])]
            return group.broadcast([target], _from_rank_0()), target

        received: dict[str, torch.Tensor] = {} if verify else None  # type: ignore[assignment]
        reload = _layerwise_reload()
        if reload is not None:
            reload[0](model)
        loaded = 0
        pending = post(0)
        for i, bucket in enumerate(buckets):
            work, target = pending
            work.wait()
            if i + 1 < len(buckets):
                pending = post(i + 1)  # the next bucket travels while this one is checked and loaded
            digest = _digest(target)
            if digest != bucket["checksum"]:
                raise RuntimeError(
                    f"weight bucket {bucket['index']} of version {version} arrived corrupted in the vLLM worker "
                    f"(digest {digest} != {bucket['checksum']})"
                )
            # copies, not views: vLLM's layerwise reload holds a layer's tensors until all of that layer has
            # arrived (a fused q/k/v or gate/up may span two buckets), and the receive buffer is reused
            tensors = [(name, view.clone()) for name, view in _views(target, bucket["metas"])]
            tensors += [(alias, t) for name, t in tensors for alias in (aliases or {}).get(name, ())]
            model.load_weights(tensors)
            loaded += len(tensors)
            if verify:
                for name, t in tensors:
                    received[name] = t if t.device.type == "cpu" else t.cpu()
        if reload is not None:
            reload[1](model, self.model_runner.model_config)
        result: dict[str, Any] = {"rank": 1 + int(self.rank), "tensors": loaded}
        if verify:
            result.update(_readback(model, received, self.vllm_config))
        return result

    def asyncflow_param_digest(self) -> str:
        """One BLAKE2b digest over every parameter of the vLLM model (tests compare it across updates)."""
        h = hashlib.blake2b(digest_size=16)
        for name, p in sorted(self.model_runner.model.named_parameters()):
            h.update(name.encode())
            h.update(memoryview(p.detach().float().cpu().contiguous().view(-1).numpy()))
        return h.hexdigest()


def loopback_gloo_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """A gloo group whose sockets are bound to 127.0.0.1 (by default gloo binds to what the hostname resolves to)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, world_size, options)


def _from_rank_0() -> Any:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's layerwise-reload session (begin, end), or None on releases without it."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _readback(model: torch.nn.Module, received: dict[str, torch.Tensor], vllm_config: Any) -> dict[str, Any]:
    """Compare every readable vLLM parameter with the tensors sent; returns mismatches and counts.

    Fused parameters are rebuilt from their parts with the model's
    ``packed_modules_mapping`` (``qkv_proj`` = q, k, v stacked on dim 0).
    Vocabulary-padded embeddings are compared on their real rows. Not
    readable, and counted as such: parameters that vLLM's post-load
    processing moved into a kernel-specific layout (on CPU the linear layers'
    weights are repacked and the parameter left empty), and shards at
    tensor-parallel size > 1. Those are covered by the log-prob probe.
    """
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    tied = bool(getattr(vllm_config.model_config.hf_config, "tie_word_embeddings", False))
    sharded = int(vllm_config.parallel_config.tensor_parallel_size) > 1
    bad: list[str] = []
    compared = unreadable = 0
    for name, param in model.named_parameters():
        actual = param.detach()
        if actual.numel() == 0:
            unreadable += 1
            continue
        expected = _expected(name, received, packed)
        if expected is None and tied and name.startswith("lm_head"):
            expected = received.get(name.replace("lm_head", "model.embed_tokens"))
        if expected is None:
            bad.append(f"{name} (no tensor sent for it)")
            continue
        actual = actual.cpu()
        if tuple(actual.shape) != tuple(expected.shape):
            padded = actual.dim() == expected.dim() and actual.shape[1:] == expected.shape[1:] \
                and actual.shape[0] > expected.shape[0]
            if padded:  # vocabulary rows padded to a multiple of 64
                actual = actual[: expected.shape[0]]
            elif sharded:
                unreadable += 1
                continue
            else:
                bad.append(f"{name} (shape {tuple(actual.shape)} != sent {tuple(expected.shape)})")
                continue
        compared += 1
        if not torch.equal(actual, expected.to(actual.dtype)):
            bad.append(name)
    return {"mismatches": bad, "compared": compared, "unreadable": unreadable}


def _expected(name: str, received: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> torch.Tensor | None:
    if name in received:
        return received[name]
    for fused, parts in packed.items():
        token = f".{fused}."
        if token in name:
            pieces = [received.get(name.replace(token, f".{part}.")) for part in parts]
            if any(p is None for p in pieces):
                return None
            return torch.cat(pieces, dim=0)
    return None

