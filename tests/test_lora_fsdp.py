"""CI entry point for the fsdp adapter's LoRA tests (they live in adapters/fsdp/tests/test_lora_fsdp.py).

CI's ``pytest`` collects ``tests/`` only; this module loads the adapter's test
module by path and exposes its tests here. Skipped when the adapter or peft
is not installed.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed (pip install -e adapters/fsdp)")
pytest.importorskip("peft", reason="LoRA needs peft (pip install 'asyncflow[lora]')")

_SOURCE = Path(__file__).parents[1] / "adapters" / "fsdp" / "tests" / "test_lora_fsdp.py"
_spec = importlib.util.spec_from_file_location("asyncflow_fsdp_lora_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items() if name.startswith(("test_", "Test"))})
