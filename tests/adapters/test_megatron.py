"""CI entry point for the asyncflow-megatron adapter's tests (they live in adapters/megatron/tests/).

CI's ``pytest`` collects ``tests/`` only; this module loads the adapter's test
module by path and exposes its tests and fixtures here. Skipped when the
adapter is not installed (``pip install -e adapters/megatron``); without
megatron-core only the pure tests (options, version check, the Hugging Face
<-> Megatron mapping) run, and the CUDA conformance classes skip without a GPU.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("asyncflow_megatron", reason="asyncflow-megatron is not installed "
                    "(pip install -e adapters/megatron)")

_SOURCE = Path(__file__).parents[2] / "adapters" / "megatron" / "tests" / "test_megatron_engine.py"
_spec = importlib.util.spec_from_file_location("asyncflow_megatron_engine_tests", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

globals().update({name: value for name, value in vars(_module).items()
                  if name.startswith(("test_", "Test")) or name in ("world1", "world2")})
