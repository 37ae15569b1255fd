"""A run that fails at the initial weight push says so in one line: the phase, the engine, the error's type."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import EngineError, WeightTransferError
from asyncflow_core.flow.runtime import run_flow
from asyncflow_plugins.toy.rollout import ToyRolloutEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "toy_grpo.yaml"
#: a model section makes the run push the trainer's weights to every replica before generating (toy engines ignore it)
MODEL = "model.hf_config={model_type: llama, vocab_size: 16, hidden_size: 8, intermediate_size: 16, " \
        "num_hidden_layers: 1, num_attention_heads: 1}"


class _Refuses(ToyRolloutEngine):
    """Refuses every update the way an engine with other tensor names does."""

    error: Exception = WeightTransferError("'model.embed_tokens.weight' is not a tensor of this model")

    async def update_weights(self, version, buckets, *, kv_cache=None):
        async for _ in buckets:
            pass
        raise self.error


def run_with(engine, tmp_path):
    resolved = resolve(load_config(EXAMPLE, [MODEL, "trainer.total_steps=2"]))
    comp = resolved.components["rollout"]
    record = dataclasses.replace(comp.registered.record, factory=engine)
    resolved.components["rollout"] = dataclasses.replace(
        comp, registered=dataclasses.replace(comp.registered, record=record))
    return run_flow(resolved, run_dir=tmp_path, write_png=False)


@pytest.mark.parametrize("error, kind", [
    (WeightTransferError("'model.embed_tokens.weight' is not a tensor of this model"), "WeightTransferError"),
    (KeyError("model.embed_tokens.weight"), "KeyError"),
])
def test_a_refused_initial_push_names_phase_engine_and_error_type(tmp_path, error, kind):
    class Engine(_Refuses):
        pass

    Engine.error = error
    with pytest.raises(EngineError) as info:
        run_with(Engine, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("initial weight push: rollout engine 'toy' (replica 0) failed to load the weights of "
                              f"trainer 'toy' ({kind}: ")
    assert "model.embed_tokens.weight" in message and "asyncflow config validate" in message


def test_a_working_engine_gets_the_initial_push(tmp_path):
    summary = run_with(ToyRolloutEngine, tmp_path)
    assert summary["stop_reason"] == "done" and summary["steps"] == 2
