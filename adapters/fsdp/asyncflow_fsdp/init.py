"""Building the sharded model without any rank holding the whole of it on its device.

Every rank builds the architecture on the ``meta`` device (shapes only, no
storage), applies ``fully_shard``, allocates just its own shards
(``to_empty``), and receives the weights from rank 0, the only rank that
builds the real model (in CPU memory): torch's
``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` broadcasts one tensor at a time and each rank
keeps its slice (``torch/distributed/checkpoint/state_dict.py`` and
``torch/distributed/_state_dict_utils.py``, torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

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
    """
    rank = dist.get_rank()
    if (source is None) != (rank != 0):
        raise ValueError(f"rank {rank}: the source model must be given on rank 0 and only there")
    tied = _tied(net)
    net.to_empty(device=device)
    if tied and not _tied(net):  # to_empty keeps shared parameters shared; say so loudly if a release does not
        raise RuntimeError("to_empty untied the input and output embeddings")
    full: dict[str, Any] = {}
    if source is not None:
        full = {name: t.detach().float() if t.is_floating_point() else t.detach()
                for name, t in source.state_dict().items()}
    set_model_state_dict(net, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # buffers state_dict does not carry are garbage after to_empty: every rank takes rank 0's
    mine = _non_persistent_buffers(net)
    theirs = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in mine:
            if source is not None:
                buf.copy_(theirs[name].to(buf.dtype))
            dist.broadcast(buf, src=0)
