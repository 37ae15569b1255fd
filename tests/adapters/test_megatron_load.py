"""CI entry point for adapters/megatron/tests/test_megatron_load.py (fresh-engine checkpoint loads, CUDA settings).

Skipped when the adapter is not installed (``pip install -e adapters/megatron``).
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_megatron", reason="asyncflow-megatron is not installed "
                    "(pip install -e adapters/megatron)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "megatron" / "tests" / "test_megatron_load.py"
_spec = importlib.util.spec_from_file_location("asyncflow_megatron_load_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items() if name.startswith(("test_", "Test"))})
