"""The model this template serves: a Hugging Face causal LM run with plain ``transformers`` calls.

It stands in for *your* engine. What the adapter needs from it is small and
is what every inference engine has in some form: load the policy the run
names, feed tokens, get next-token logits, and keep per-request state (here
a ``transformers`` KV cache) so each decoding step feeds only new tokens.

The model is built by the same function the trainers use
(``asyncflow_plugins.hf.model.build_causal_lm``), so an ``hf_config`` with the
trainer's seed gives the trainer's exact version-0 weights, and the tensor
names of a weight update are the ones the trainers export (Hugging Face
``state_dict`` keys, a tied ``lm_head`` sent once as ``model.embed_tokens.weight``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from asyncflow_core.config.models import ModelConfig


def load(model: ModelConfig, seed: int, device: str) -> torch.nn.Module:
    """The policy in ``model.dtype`` on ``device``, in eval mode (replace with your engine's loader)."""
    from asyncflow_plugins.hf.model import build_causal_lm

    return build_causal_lm(model, seed=seed, device=device)


def context_limit(net: torch.nn.Module) -> int | None:
    """Most positions the model takes (prompt + completion), from its config."""
    positions = getattr(net.config, "max_position_embeddings", None) or getattr(net.config, "n_positions", None)
    return int(positions) if positions else None


def vocab_size(net: torch.nn.Module) -> int:
    """Rows of the output projection: token ids are below it."""
    return int(net.get_output_embeddings().weight.shape[0])


@torch.no_grad()
def next_logits(net: torch.nn.Module, tokens: list[int], cache: Any, device: str) -> tuple[torch.Tensor, Any]:
    """Feed ``tokens`` after what ``cache`` holds (None: nothing yet); float32 logits of the next token, new cache."""
    from transformers import DynamicCache

    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    # transformers 5.x calls the key/value cache ``cache`` (``past_key_values`` goes in 5.40); 4.x the old name
    name = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
    out = net(input_ids=ids, use_cache=True, **{name: cache if cache is not None else DynamicCache()})
    return out.logits[0, -1].float().cpu(), getattr(out, name)
