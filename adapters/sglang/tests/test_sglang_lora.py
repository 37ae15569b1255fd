"""LoRA with the ``sglang`` rollout engine: refused, in one line, before anything starts."""

from __future__ import annotations

import pytest

from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types.adapter import LoraSpec


def test_configure_adapter_is_refused_with_what_to_do_instead():
    engine = get_plugin_manager().create("rollout_engine", "sglang", {"url": "http://127.0.0.1:9"})
    assert engine.features.supports_adapter_updates is False
    with pytest.raises(UnsupportedFeatureError, match=r"unset trainer\.lora.*vllm or torch") as info:
        engine.configure_adapter(LoraSpec(rank=8))
    assert "\n" not in str(info.value)
