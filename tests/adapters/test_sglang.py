"""CI entry point for the asyncflow-sglang adapter's tests (they live in adapters/sglang/tests/).

CI's ``pytest`` collects ``tests/`` only; this module loads the adapter's test
module by path and exposes its tests and fixtures here. Skipped when the
adapter is not installed (``pip install --no-deps -e adapters/sglang``). The
tests run against the adapter's protocol fake of the SGLang server, never a
real SGLang (which needs a GPU).
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_sglang", reason="asyncflow-sglang is not installed (pip install -e adapters/sglang)")
pytest.importorskip("httpx", reason="asyncflow-sglang needs httpx (pip install httpx)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "sglang" / "tests" / "test_sglang_engine.py"
_spec = importlib.util.spec_from_file_location("asyncflow_sglang_engine_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items()
                  if name.startswith(("test_", "Test")) or name in ("shared_fake", "fake")})
