"""CI entry point for adapters/fsdp/tests/test_fsdp_world1.py (the fsdp engine at one rank without FSDP).

Loads the adapter's test module by path, as tests/adapters/test_fsdp.py does.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "fsdp" / "tests" / "test_fsdp_world1.py"
_spec = importlib.util.spec_from_file_location("asyncflow_fsdp_world1_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items()
                  if name.startswith(("test_", "Test"))})
