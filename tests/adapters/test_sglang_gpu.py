"""CI entry point for the asyncflow-sglang adapter's GPU tests (they live in adapters/sglang/tests/test_sglang_gpu.py).

``make test-gpu`` (``pytest -m gpu tests``) collects ``tests/`` only; this
module loads the adapter's GPU test module by path and exposes its test
classes here. Skipped when the adapter or SGLang is not installed; the
repository's conftest skips the ``gpu``-marked classes without CUDA. These
run the conformance suite against a real SGLang server, never the protocol
fake.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_sglang", reason="asyncflow-sglang is not installed (pip install -e adapters/sglang)")
pytest.importorskip("httpx", reason="asyncflow-sglang needs httpx (pip install httpx)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "sglang" / "tests" / "test_sglang_gpu.py"
_spec = importlib.util.spec_from_file_location("asyncflow_sglang_gpu_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items() if name.startswith(("test_", "Test"))})
