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
   byte offset of each tensor, the bucket's size and digest), then
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

Failures are reported, not raised: ``asyncflow_load`` returns ``error`` and
whether it had begun to change the model (``touched``). The model is touched
only once the first bucket has arrived (that is when the layerwise-reload
session starts), so a transfer that never comes leaves the old weights whole
and the engine can keep serving them. NCCL waits end at the update's
deadline (see :mod:`asyncflow_vllm.weight_group`).
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any

import torch

from asyncflow_vllm import weight_group

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
    """The bucket digest every producer and checker uses (asyncflow_core's ``weight_digest``; device buffers are
    copied to the host first)."""
    from asyncflow_core.types import weight_digest

    return weight_digest(buffer)


def _views(buffer: torch.Tensor, metas: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for m in metas:
        dtype = _DTYPES[m["dtype"]]
        nbytes = int(torch.Size(m["shape"]).numel()) * dtype.itemsize
        out.append((m["name"], buffer[m["offset"] : m["offset"] + nbytes].view(dtype).view(m["shape"])))
    return out


class WeightSyncExtension:
    """Methods vLLM adds to its worker; called by the ``vllm`` engine through ``collective_rpc``."""

    def asyncflow_device(self) -> dict[str, Any]:
        """This worker's device and, on CUDA, its UUID (the engine keeps its own rank off these GPUs)."""
        device = _device_of(self)
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
        return {"rank": 1 + int(self.rank), "device": str(device), "uuid": uuid}

    def asyncflow_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        """Join the weight group as rank 1 + this worker's rank; returns that rank.

        With NCCL the communicator is created here, by a one-byte broadcast
        from rank 0, so that an update never waits on communicator setup.
        """
        from torch.distributed import TCPStore

        self.asyncflow_leave()  # a group left over from a failed update: its communicator may be aborted
        rank = 1 + int(self.rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        deadline = time.time() + timeout_s
        store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        if backend == "nccl":
            device = _device_of(self)
            group = weight_group.nccl_group(store, rank, world_size, timeout_s)
            store.set(f"asyncflow/joined/{rank}", str(device))
            try:
                probe = torch.zeros(1, dtype=torch.uint8, device=device)
                weight_group.wait(group.broadcast([probe], weight_group.from_rank_0()), backend, deadline)
            except BaseException:
                weight_group.abort(group, backend)
                raise
        else:
            group = loopback_gloo_group(store, rank, world_size, timeout)
            device = torch.device("cpu")
        self._asyncflow_group = group
        self._asyncflow_store = store
        self._asyncflow_device = device
        self._asyncflow_backend = backend
        return rank

    def asyncflow_leave(self) -> None:
        """Drop the weight group (an NCCL one is aborted: that never waits on the other ranks)."""
        weight_group.abort(getattr(self, "_asyncflow_group", None), getattr(self, "_asyncflow_backend", "gloo"))
        self._asyncflow_group = None
        self._asyncflow_store = None

    def asyncflow_load(
        self,
        version: int,
        buckets: list[dict[str, Any]],
        verify: bool,
        aliases: dict[str, list[str]] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Receive ``buckets`` by broadcast from rank 0 and load them; see the module docstring.

        ``deadline`` (``time.time()`` seconds) ends every NCCL wait. Returns
        ``error`` and ``touched`` instead of raising, so the engine learns
        whether this worker's weights are still the old ones.
        """
        rank = 1 + int(self.rank)
        state = {"touched": False}
        try:
            return self._asyncflow_load(version, buckets, verify, aliases or {}, deadline, state)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which decides what the replica can do
            self.asyncflow_leave()  # its communicator may have been aborted, and a peer may be mid-transfer
            text = str(exc).strip()
            reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            return {"rank": rank, "error": reason, "touched": state["touched"]}

    def _asyncflow_load(
        self,
        version: int,
        buckets: list[dict[str, Any]],
        verify: bool,
        aliases: dict[str, list[str]],
        deadline: float | None,
        state: dict[str, bool],
    ) -> dict[str, Any]:
        group = getattr(self, "_asyncflow_group", None)
        if group is None:
            raise RuntimeError("asyncflow_load before asyncflow_join: the weight group is not set up")
        device = self._asyncflow_device
        backend = getattr(self, "_asyncflow_backend", "gloo")
        if deadline is None:
            deadline = time.time() + 24 * 3600.0
        model = self.model_runner.model
        largest = max(int(b["nbytes"]) for b in buckets)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(2, len(buckets)))]

        def post(i: int) -> Any:
            target = buffers[i % len(buffers)][: int(buckets[i]["nbytes"])]
            return group.broadcast([target], weight_group.from_rank_0()), target

        received: dict[str, torch.Tensor] = {} if verify else None  # type: ignore[assignment]
        reload = _layerwise_reload()
        in_session = False
        loaded = 0
        pending = post(0)
        try:
            for i, bucket in enumerate(buckets):
                work, target = pending
                weight_group.wait(work, backend, deadline)
                if i + 1 < len(buckets):
                    pending = post(i + 1)  # the next bucket travels while this one is checked and loaded
                digest = _digest(target)
                if digest != bucket["checksum"]:
                    raise RuntimeError(
                        f"weight bucket {bucket['index']} of version {version} arrived corrupted in the vLLM worker "
                        f"(digest {digest} != {bucket['checksum']})"
                    )
                if not state["touched"]:
                    # the model changes from here on: a transfer that never arrived left it as it was
                    state["touched"] = True
                    if reload is not None:
                        reload[0](model)
                        in_session = True
                # copies, not views: vLLM's layerwise reload holds a layer's tensors until all of that layer has
                # arrived (a fused q/k/v or gate/up may span two buckets), and the receive buffer is reused
                tensors = [(name, view.clone()) for name, view in _views(target, bucket["metas"])]
                tensors += [(alias, t) for name, t in tensors for alias in aliases.get(name, ())]
                model.load_weights(tensors)
                loaded += len(tensors)
                if verify:
                    for name, t in tensors:
                        received[name] = t if t.device.type == "cpu" else t.cpu()
        finally:
            if in_session:  # also after a failure: parameters left on the meta device would break the next step
                reload[1](model, self.model_runner.model_config)
        result: dict[str, Any] = {"rank": 1 + int(self.rank), "tensors": loaded, "touched": True}
        if verify:
            parallel = self.vllm_config.parallel_config
            tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
            result.update(_readback(model, received, tied=tied,
                                    tensor_parallel_size=int(parallel.tensor_parallel_size)))
        return result

    def asyncflow_param_digest(self) -> str:
        """One BLAKE2b digest over every parameter of the vLLM model (tests compare it across updates)."""
        h = hashlib.blake2b(digest_size=16)
        for name, p in sorted(self.model_runner.model.named_parameters()):
            h.update(name.encode())
            h.update(memoryview(p.detach().float().cpu().contiguous().view(-1).numpy()))
        return h.hexdigest()


def _device_of(worker: Any) -> torch.device:
    """The worker's device: vLLM's GPU worker keeps it as ``device``; the current CUDA device otherwise."""
    device = getattr(worker, "device", None)
    if isinstance(device, torch.device):
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def loopback_gloo_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """A gloo group whose sockets are bound to 127.0.0.1 (by default gloo binds to what the hostname resolves to)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, world_size, options)


def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's layerwise-reload session (begin, end), or None on releases without it."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _readback(
    model: torch.nn.Module, received: dict[str, torch.Tensor], *, tied: bool, tensor_parallel_size: int
) -> dict[str, Any]:
    """Compare every readable vLLM parameter with the tensors sent; returns mismatches and counts.

    Fused parameters are rebuilt from their parts with the model's
    ``packed_modules_mapping`` (``qkv_proj`` = q, k, v stacked on dim 0).
    Vocabulary embeddings and output projections (vLLM's
    ``VocabParallelEmbedding`` / ``ParallelLMHead``) are compared on the real
    rows of this rank's shard only (:func:`real_vocab_rows`): padding rows are
    not the model's, and at tensor-parallel size > 1 a rank past the end of a
    small vocabulary holds padding only (``padding_only``). Not readable, and
    counted as such: parameters that vLLM's post-load processing moved into a
    kernel-specific layout (on CPU the linear layers' weights are repacked and
    the parameter left empty), and other shards at tensor-parallel size > 1.
    Those are covered by the log-prob probe.
    """
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    vocab = _vocab_shards(model)
    sharded = tensor_parallel_size > 1
    bad: list[str] = []
    compared = unreadable = padding_only = 0
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
        shard = vocab.get(name)
        if shard is not None and actual.shape[1:] == expected.shape[1:]:
            rows = real_vocab_rows(actual, expected, shard)
            if rows is None:
                padding_only += 1
                continue
            actual, expected = rows
        elif tuple(actual.shape) != tuple(expected.shape):
            if sharded:
                unreadable += 1
                continue
            bad.append(f"{name} (shape {tuple(actual.shape)} != sent {tuple(expected.shape)})")
            continue
        compared += 1
        if not torch.equal(actual, expected.to(actual.dtype)):
            bad.append(name)
    return {"mismatches": bad, "compared": compared, "unreadable": unreadable, "padding_only": padding_only}


def vocab_shard_rows(shard: Any) -> list[tuple[slice, slice]]:
    """Pairs (rows of a vocabulary shard, rows of the full tensor) that hold real tokens.

    ``shard`` is vLLM's ``VocabParallelEmbeddingShardIndices`` (its
    ``vocab_parallel_embedding.py``): a rank's shard holds its rows of the
    original vocabulary first (token ids ``org_vocab_start_index`` up to
    ``org_vocab_end_index``), padding up to ``num_org_elements_padded``, then
    its rows of the added (LoRA) vocabulary (``added_vocab_start_index`` up to
    ``added_vocab_end_index``), then padding. Token id = row of the full
    tensor. A shard past the end of the vocabulary has no pairs.
    """
    pairs = []
    n_org = shard.org_vocab_end_index - shard.org_vocab_start_index
    if n_org > 0:
        pairs.append((slice(0, n_org), slice(shard.org_vocab_start_index, shard.org_vocab_end_index)))
    n_added = shard.added_vocab_end_index - shard.added_vocab_start_index
    if n_added > 0:
        first = shard.padded_org_vocab_end_index - shard.padded_org_vocab_start_index
        pairs.append((slice(first, first + n_added),
                      slice(shard.added_vocab_start_index, shard.added_vocab_end_index)))
    return pairs


def real_vocab_rows(
    actual: torch.Tensor, expected: torch.Tensor, shard: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of a vocabulary shard that hold tokens, and the same tokens' rows of the full tensor sent.

    None when the shard holds padding only. Rows of added (LoRA) tokens are
    left out when the tensor sent does not have them.
    """
    pairs = [(mine, full) for mine, full in vocab_shard_rows(shard) if full.stop <= expected.shape[0]]
    if not pairs:
        return None
    return torch.cat([actual[mine] for mine, _ in pairs]), torch.cat([expected[full] for _, full in pairs])


def _vocab_shards(model: torch.nn.Module) -> dict[str, Any]:
    """Parameter name -> shard indices, for the vocabulary-sharded parameters of vLLM's embedding layers."""
    out: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        shard = getattr(module, "shard_indices", None)
        if shard is None or not hasattr(shard, "org_vocab_start_index"):
            continue
        for pname, param in module.named_parameters(recurse=False):
            # vLLM marks the dimension it shards the vocabulary on as output_dim (0 for these weights)
            if getattr(param, "output_dim", None) == 0 and getattr(param, "packed_dim", None) is None:
                out[f"{prefix}.{pname}" if prefix else pname] = shard
    return out


def _expected(name: str, received: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> torch.Tensor | None:
    # with enable_lora vLLM wraps each LoRA-capable layer and keeps the original one as ``base_layer``
    name = name.replace(".base_layer.", ".")
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

