"""``trainer.lora`` (asyncflow_core.types.adapter.LoraSpec): the config section, its peft config, and the
trainers that refuse it with one line (toy: no Hugging Face model; megatron: not wired in).

The fsdp trainer's LoRA tests live in adapters/fsdp/tests/test_lora_fsdp.py (run here by tests/test_lora_fsdp.py).
"""

from __future__ import annotations

import pytest

from asyncflow_core.config.models import RunConfig, TrainerConfig
from asyncflow_core.errors import UnsupportedFeatureError
from asyncflow_core.plugins import get_plugin_manager
from asyncflow_core.types.adapter import DEFAULT_TARGET_MODULES, LoraSpec


def test_presence_turns_lora_on_with_the_documented_defaults():
    assert TrainerConfig().lora is None
    cfg = RunConfig.model_validate({"reward": {"name": "arithmetic"}, "trainer": {"name": "fsdp", "lora": {}}})
    spec = cfg.trainer.lora
    assert spec == LoraSpec()
    assert (spec.rank, spec.alpha, spec.dropout, spec.export) == (8, 16.0, 0.0, "merged")
    assert spec.target_modules == DEFAULT_TARGET_MODULES == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert spec.modules_to_save == ()


@pytest.mark.parametrize("bad, word", [({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"),
                                       ({"export": "full"}, "export"), ({"target_modules": []}, "target_modules"),
                                       ({"ranks": 8}, "ranks")])
def test_bad_lora_options_are_refused_naming_the_field(bad, word):
    with pytest.raises(ValueError, match=word):
        TrainerConfig(lora=bad)


def test_peft_config_carries_every_field():
    peft = pytest.importorskip("peft")
    spec = LoraSpec(rank=4, alpha=32, dropout=0.1, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",))
    c = spec.peft_config()
    assert isinstance(c, peft.LoraConfig)
    assert (c.r, c.lora_alpha, c.lora_dropout, c.bias) == (4, 32, 0.1, "none")
    assert set(c.target_modules) == {"q_proj", "v_proj"} and list(c.modules_to_save) == ["lm_head"]
    assert str(c.task_type.value if hasattr(c.task_type, "value") else c.task_type) == "CAUSAL_LM"
    assert LoraSpec().peft_config().modules_to_save is None


def test_adapter_names_are_peft_state_dict_keys_without_the_adapter_name():
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from asyncflow_core.types.adapter import adapter_state_dict, wrap

    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    net = wrap(transformers.AutoModelForCausalLM.from_config(cfg), LoraSpec(rank=2))
    names = set(adapter_state_dict(net))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 2 * 7 * 2  # A and B of seven projections in two layers
    assert not any(".default." in n for n in names)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert {n.replace(".default", "") for n in trainable} == names


def test_toy_trainer_refuses_lora_in_one_line():
    with pytest.raises(UnsupportedFeatureError, match=r"^trainer.lora: the toy trainer.*use the fsdp trainer"):
        get_plugin_manager().create("train_engine", "toy", {"lora": {}})
    assert not get_plugin_manager().create("train_engine", "toy", {}).features.supports_lora


def test_megatron_trainer_refuses_lora_in_one_line():
    pytest.importorskip("asyncflow_megatron", reason="asyncflow-megatron is not installed")
    with pytest.raises(UnsupportedFeatureError, match=r"^trainer.lora: the megatron trainer does not train LoRA.*fsdp"):
        get_plugin_manager().create("train_engine", "megatron", {"lora": {"rank": 4}})


def test_fsdp_declares_lora():
    pytest.importorskip("asyncflow_fsdp", reason="asyncflow-fsdp is not installed")
    from asyncflow_fsdp.config import DECLARED_FEATURES

    assert DECLARED_FEATURES.supports_lora
