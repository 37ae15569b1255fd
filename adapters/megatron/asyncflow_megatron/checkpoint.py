"""Model and optimizer state in and out of megatron-core's ``dist_checkpointing`` (megatron-core 0.16).

The plain calls are not enough in megatron-core 0.16.1; each point below was
read in its source (``megatron/core/optimizer/optimizer.py``,
``optimizer/distrib_optimizer.py``, ``dist_checkpointing/mapping.py``):

* The *load* template must be built with ``sharded_state_dict(...,
  is_loading=True)``: that allocates the optimizer state a fresh optimizer
  does not have yet (Adam's moments), so the checkpoint has a place to land.
  Without it a fresh engine's float32 / float16 optimizer loads no moments at
  all (silently: the next step is a first Adam step again), and the
  ``DistributedOptimizer`` raises ``KeyError: 'exp_avg'``.
* The ``DistributedOptimizer``'s default layout, ``fully_sharded_model_space``,
  makes ShardedTensors with a ``flattened_range``, which 0.16's ShardedTensor
  refuses (``flattened_range is not supported``). Both save and load name
  ``dp_reshardable`` (Megatron-LM's own default): fully parallel, no gather;
  it reshards across data-parallel ranks only.
* With torch's Adam / AdamW (megatron's fallback when neither Transformer
  Engine nor Apex imports) the ``DistributedOptimizer``'s ``state_dict()``
  asserts one common ``step`` over the per-parameter states, so an optimizer
  that never stepped fails ``len(steps) == 1``: :func:`prime_torch_adam_state`
  gives it torch's own initial state first (zero moments, step 0). And after
  a load every parameter's ``step`` is the template's value, not the
  checkpoint's, held in one tensor shared by all parameters, which torch's
  Adam increments in place once per parameter:
  :func:`restore_torch_adam_steps` gives each parameter its own step tensor
  with the checkpoint's value.
* The load must run without autograd: for float32 parameters the
  DistributedOptimizer's main shards are views of the parameters, and its
  in-place copy into them is refused under autograd (the worker's ``op_load``
  wraps it in ``torch.no_grad()``).
"""

from __future__ import annotations

from typing import Any

import torch

#: the DistributedOptimizer's checkpoint layout (see the module docstring)
DISTRIBUTED_OPTIMIZER_FORMAT = "dp_reshardable"
_TORCH_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def megatron_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer``'s parts, or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def optimizer_metadata(optimizer: Any) -> dict[str, Any] | None:
    """The ``metadata`` argument of ``sharded_state_dict``: names the DistributedOptimizer's layout, else none."""
    if any(_is_distributed(opt) for opt in megatron_optimizers(optimizer)):
        return {"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT}
    return None


def prime_torch_adam_state(optimizer: Any) -> int:
    """Give every parameter of a DistributedOptimizer's torch Adam its initial state (zero moments, step 0).

    Only parameters with no state are touched (the values are overwritten by
    the load). Returns how many parameters were primed.
    """
    primed = 0
    for opt in megatron_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not (_is_distributed(opt) and isinstance(inner, _TORCH_ADAM)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                # torch's Adam._init_group: a float32 scalar step on the CPU (fused / capturable keep it on p's device)
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else None)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                primed += 1
    return primed


def checkpoint_steps(optimizer: Any, loaded: Any) -> list[float | None]:
    """The step each megatron optimizer's part of a loaded state dict carries in its param groups (None: none).

    Read it before ``load_state_dict``, which consumes parts of the state dict.
    """
    opts = megatron_optimizers(optimizer)
    parts = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    steps: list[float | None] = []
    for part in parts:
        inner = part.get("optimizer") if isinstance(part, dict) else None
        groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
        found = {float(g["step"]) for g in groups if g.get("step") is not None}
        if len(found) > 1:
            raise RuntimeError(f"the checkpoint's optimizer param groups disagree on the step: {sorted(found)}")
        steps.append(found.pop() if found else None)
    return steps


def restore_torch_adam_steps(optimizer: Any, steps: list[float | None]) -> int:
    """After a DistributedOptimizer load: each torch-Adam parameter gets its own step tensor holding ``steps``' value.

    ``steps`` comes from :func:`checkpoint_steps`. Returns how many parameters were given their step.
    """
    restored = 0
    for opt, step in zip(megatron_optimizers(optimizer), steps, strict=True):
        inner = getattr(opt, "optimizer", None)
        if step is None or not (_is_distributed(opt) and isinstance(inner, _TORCH_ADAM)):
            continue
        for state in inner.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)
                restored += 1
    return restored


def optimizer_format(distributed: bool) -> str:
    """How the optimizer state is laid out in a checkpoint; a load needs the same layout."""
    return f"distributed/{DISTRIBUTED_OPTIMIZER_FORMAT}" if distributed else "local"


def load_problem(meta: dict[str, Any], *, distributed: bool, tp: int, pp: int) -> str | None:
    """Why a checkpoint (its ``asyncflow_megatron.json``) cannot load into this engine; None when it can."""
    saved = meta.get("optimizer_format", "local")
    want = optimizer_format(distributed)
    if saved != want:
        flag = "true" if saved.startswith("distributed/") else "false"
        return (f"the checkpoint's optimizer state is {saved!r} and this engine's is {want!r}; load it with "
                f"use_distributed_optimizer: {flag}")
    grid = (meta.get("tensor_parallel_size", tp), meta.get("pipeline_parallel_size", pp))
    if distributed and grid != (tp, pp):
        return (f"the checkpoint was saved at tensor_parallel_size x pipeline_parallel_size = {grid[0]} x {grid[1]} "
                f"and this engine runs {tp} x {pp}; the distributed optimizer's layout ({DISTRIBUTED_OPTIMIZER_FORMAT})"
                " reshards across data-parallel ranks only: load it with the same TP and PP")
    return None


def sharded_state(model: Any, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """The sharded state dict of ``model`` (the GPTModel stage) and ``optimizer``, for a save or a load."""
    if is_loading:
        prime_torch_adam_state(optimizer)
    model_sd = model.sharded_state_dict()
    metadata = optimizer_metadata(optimizer)
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}
