"""CI entry point for adapters/fsdp/tests/test_forward_chunked.py (the chunked log-prob head: equal log-probs and
gradients to the whole path, logits never kept for backward; CPU)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "fsdp" / "tests" / "test_forward_chunked.py"
_spec = importlib.util.spec_from_file_location("asyncflow_fsdp_forward_chunked_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items() if name.startswith(("test_", "Test"))})
