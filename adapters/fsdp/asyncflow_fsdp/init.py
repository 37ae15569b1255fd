"""Building the sharded model without any rank holding the whole of it on its device.

Every rank builds the architecture on the ``meta`` device (shapes only, no
storage), applies ``fully_shard``, allocates just its own shards
(``to_empty``), and receives the weights from rank 0, the only rank that
builds the real model (in CPU memory), one tensor at a time: rank 0 casts
each source tensor to float32 only when it sends it and frees it once sent,
so beside the source and its own shards it holds one tensor, never a float32
copy of the whole model (what passing ``{name: t.float()}`` to torch's
``set_model_state_dict(..., broadcast_from_rank0=True)`` built for a
bfloat16 checkpoint, and torch keeps every tensor it was given until it
returns, ``torch/distributed/_state_dict_utils.py``, torch 2.13). The
shards are allocated up front (``to_empty``), so rank 0 still holds the
source beside its own shards at the start: at world 1 that is two float32
models, which is why the engine runs one rank without FSDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from asyncflow_core.config.models import ModelConfig
from asyncflow_core.errors import EngineError
from asyncflow_plugins.hf.model import hf_config


def meta_skeleton(model: ModelConfig) -> torch.nn.Module:
    """The architecture of ``model`` in float32 on the meta device (no weights), in eval mode."""
    import transformers

    cfg = hf_config(model)
    try:
        with torch.device("meta"):
            net = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=torch.float32, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise EngineError(f"could not build the model ({type(exc).__name__}: {exc})") from exc
    return net.eval()


def _non_persistent_buffers(net: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that ``state_dict`` leaves out (e.g. RoPE's ``inv_freq``), in a fixed order."""
    saved = set(net.state_dict(keep_vars=True))
    return [(name, buf) for name, buf in net.named_buffers() if name not in saved]


def _tied(net: torch.nn.Module) -> bool:
    out = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    return out is not None and out.weight is net.get_input_embeddings().weight


def materialize_from_rank0(net: torch.nn.Module, source: torch.nn.Module | None, device: torch.device) -> None:
    """Allocate ``net``'s shards on ``device`` and fill them with ``source``'s weights (given on rank 0 only).

    ``net`` is the sharded meta skeleton; ``source`` is the real model, on
    rank 0, in any dtype (its weights arrive as float32, the master weights).
    Tied input and output embeddings stay one parameter. A collective: every
    rank calls it.

    One tensor at a time: rank 0 casts it and sends it (``distribute_tensor``
    scatters a sharded one, a plain one is broadcast), every rank copies its
    slice, and rank 0 then drops the source's tensor, so the only extra
    memory is one tensor. ``source`` is consumed: its parameters and
    persistent buffers are empty afterwards.
    """
    rank = dist.get_rank()
    if (source is None) != (rank != 0):
        raise ValueError(f"rank {rank}: the source model must be given on rank 0 and only there")
    tied = _tied(net)
    net.to_empty(device=device)
    if tied and not _tied(net):  # to_empty keeps shared parameters shared; say so loudly if a release does not
        raise RuntimeError("to_empty untied the input and output embeddings")
    # buffers state_dict does not carry are garbage after to_empty: every rank takes rank 0's (small; first,
    # before the source is emptied)
    theirs = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in _non_persistent_buffers(net):
            if source is not None:
                buf.copy_(theirs[name].to(buf.dtype))
            dist.broadcast(buf, src=0)
    del theirs
    mine = net.state_dict(keep_vars=True)
    full = source.state_dict(keep_vars=True) if source is not None else {}
    if source is not None and set(full) != set(mine):
        missing, extra = sorted(set(mine) - set(full)), sorted(set(full) - set(mine))
        raise ValueError(f"the source model's tensors differ from the skeleton's: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    # keys that name one tensor (tied weights) are sent once; a source tensor is dropped as soon as every tensor of
    # the skeleton that takes it has it (tied embeddings: after the first of their two keys)
    waiting: dict[int, set[int]] = {}
    for key, target in mine.items():
        if key in full and isinstance(target, torch.Tensor):
            waiting.setdefault(id(full[key]), set()).add(id(target))
    done: set[int] = set()
    with torch.no_grad():
        for key, target in mine.items():
            theirs_t = full.pop(key, None)
            if not isinstance(target, torch.Tensor):  # extra state: not a tensor, nothing to send
                continue
            if id(target) not in done:
                done.add(id(target))
                _receive(target, theirs_t, rank)
            if theirs_t is not None:
                left = waiting.get(id(theirs_t), set())
                left.discard(id(target))
                if not left:
                    _drop(theirs_t)
            del theirs_t


def _receive(target: torch.Tensor, source: torch.Tensor | None, rank: int) -> None:
    """Fill ``target`` (a sharded DTensor or a plain tensor) with rank 0's ``source``; a collective."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if rank == 0:
        assert source is not None
        whole = source.detach().to(device=local.device, dtype=local.dtype)
    else:
        whole = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    if isinstance(target, DTensor):
        part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=0)
        local.copy_(part.to_local())
    else:
        dist.broadcast(whole, src=0)
        local.copy_(whole)


def _drop(tensor: torch.Tensor) -> None:
    """Release a source tensor's memory (its module keeps an empty tensor of the same dtype in its place)."""
    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
