"""Which CUDA device a rank uses: moved to the core's rank-worker side, shared by every rank-group engine.

:func:`asyncflow_core.launchers.rank_worker.rank_device` is the function;
this module keeps the old import path working.
"""

from __future__ import annotations

from asyncflow_core.launchers.rank_worker import rank_device

__all__ = ["rank_device"]
