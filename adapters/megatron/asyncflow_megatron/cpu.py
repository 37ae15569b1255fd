"""Running megatron-core on a CPU, for tests on machines without a GPU (``device: cpu``).

megatron-core is written for CUDA. With the fused kernels switched off
(:func:`asyncflow_megatron.model.transformer_config_kwargs` does that for
``cpu``), what is left are a few unconditional CUDA calls on the forward
path; :func:`enable` replaces exactly those, in the rank process only:

* ``torch.cuda.current_device()`` is asked for the device of scratch buffers
  and of the RoPE frequencies: answer ``"cpu"``; ``torch.cuda.synchronize()``
  (the pipeline's point-to-point exchange waits on the CUDA stream): there
  is no CUDA work to wait for, so it returns at once;
* the model-parallel RNG tracker forks CUDA generator state around attention
  dropout: a tracker whose fork is a no-op (dropout is 0 in this engine, so no
  random number is drawn inside it);
* a few modules create small bookkeeping tensors with a literal
  ``device="cuda"`` (the schedule's token counter, the optimizer's overflow
  flags, the gradient-norm scratch): in exactly those modules, the tensor
  factories see ``"cpu"`` instead (:data:`PATCHED_MODULES`);
* the gradient-clipping helper asserts that every gradient is a
  ``torch.cuda.FloatTensor``: the optimizer module gets :func:`_clip_grads`,
  the same rule (scale every gradient by ``max_norm / (total_norm + 1e-6)``
  when that is below 1) without the device assertion.

Nothing else is replaced: the GPTModel, the pipeline schedule, Megatron's
DistributedDataParallel and optimizer run their own code on gloo. This is a
test path, not a way to train: it is slow and has never been tuned.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: megatron-core modules that allocate with a literal device="cuda"; they see :class:`_CPUTorch` as ``torch``
PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")

_enabled = False


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _CPUTorch:
    """``torch`` as seen by :data:`PATCHED_MODULES`: the same module, but tensor factories never ask for CUDA."""

    def __init__(self) -> None:
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _CPURNGTracker:
    """Stands in for megatron's CudaRNGStatesTracker where there is no CUDA generator to fork."""

    def __init__(self) -> None:
        self.states_: dict[str, object] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, object]:
        return dict(self.states_)

    def set_states(self, states: dict[str, object]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


def _clip_grads(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` rule, on CPU gradients."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def enable() -> None:
    """Patch this process so megatron-core's forward, backward and optimizer run on the CPU. Idempotent."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise RuntimeError("asyncflow_megatron.cpu.enable() is for machines without CUDA; use device: cuda")
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    mp_random._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core.optimizer import optimizer as mp_optimizer

    mp_optimizer.clip_grad_by_total_norm_fp32 = _clip_grads
    proxy = _CPUTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy  # type: ignore[attr-defined]
    _enabled = True
