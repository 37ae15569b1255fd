"""CI entry point for the asyncflow-fsdp adapter's tests (they live in adapters/fsdp/tests/).

CI's ``pytest`` collects ``tests/`` only; this module loads the adapter's test
module by path and exposes its tests and fixtures here. Skipped when the
adapter is not installed (``pip install --no-deps -e adapters/fsdp``).
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "fsdp" / "tests" / "test_fsdp_engine.py"
_spec = importlib.util.spec_from_file_location("asyncflow_fsdp_engine_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items()
                  if name.startswith(("test_", "Test"))})
