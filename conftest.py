"""Repository-wide pytest hooks (loaded for ``tests/`` and every ``adapters/*/tests``).

Tests marked ``gpu`` need CUDA. Without a CUDA device they are skipped with one
reason line, so ``make test`` stays green on a CPU-only machine, while
``make test-gpu`` (``pytest -m gpu``) runs exactly those tests on a GPU host.
"""

import pytest


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    for item in items:
        # GPU tests launch servers and load models: a longer deadline than the suite's (pytest-timeout), unless
        # the test names its own
        if item.get_closest_marker("gpu") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1800))
    if _cuda_devices():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu-marked; run `make test-gpu` on a CUDA host)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
