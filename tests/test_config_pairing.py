"""``asyncflow config validate`` checks that the rollout engine accepts what the trainer exports, loading no weights."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from asyncflow_core.config.hf import hf_export, meta_tensors
from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.config.pairing import check_against, check_weight_pairing
from asyncflow_core.errors import ConfigError
from asyncflow_core.types import ModelTensors

REPO = Path(__file__).parents[1]
TOY = REPO / "examples" / "toy_grpo.yaml"
ARITHMETIC = REPO / "examples" / "arithmetic_grpo.yaml"


def validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncflow_core", "config", "validate", *args],
                          capture_output=True, text=True, cwd=REPO)


def test_toy_engines_pair_and_a_vocabulary_mismatch_is_refused(monkeypatch):
    monkeypatch.chdir(REPO)
    assert check_weight_pairing(resolve(load_config(TOY))) is None
    with pytest.raises(ConfigError) as info:
        check_weight_pairing(resolve(load_config(TOY, ["rollout.options.vocab_size=32"])))
    assert str(info.value) == ("rollout engine 'toy' would refuse the weights trainer 'toy' exports: bigram.weight: "
                               "shape (16, 16) does not match the engine's (32, 32)")


def test_cli_validate_refuses_a_mismatch_in_one_line():
    ok = validate(str(TOY))
    assert ok.returncode == 0 and "valid" in ok.stdout and "weights pairing" not in ok.stderr
    bad = validate(str(TOY), "trainer.options.vocab_size=8")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    assert "would refuse the weights trainer 'toy' exports: bigram.weight: shape (8, 8)" in bad.stderr


def test_an_engine_that_declares_nothing_is_reported_unchecked():
    proc = validate(str(REPO / "examples" / "sim_7b.yaml"))
    assert proc.returncode == 0
    assert "note: weights pairing not checked: rollout engine 'sim' does not declare which weights it accepts" \
        in proc.stderr


def test_listings_are_built_on_the_meta_device():
    model = load_config(ARITHMETIC).model
    tensors = meta_tensors(model)
    assert tensors and all(t.is_meta for _, t in tensors)
    exported = hf_export(model)
    # the tied output projection is exported once, under the embedding's name
    assert "model.embed_tokens.weight" in exported and "lm_head.weight" not in exported
    assert exported["model.embed_tokens.weight"] == (14, 64)


def test_torch_engine_accepts_the_hf_export_and_names_the_first_tensor_at_fault():
    model = load_config(ARITHMETIC).model
    accepted = ModelTensors.of(meta_tensors(model))
    exported = hf_export(model)
    check_against(accepted, exported)  # the same model: accepted
    with pytest.raises(ValueError, match=r"'model.embed.weight' is not a tensor of the engine's model"):
        check_against(accepted, {"model.embed.weight": (14, 64), **exported})
    partial = dict(exported)
    del partial["model.norm.weight"]
    with pytest.raises(ValueError, match=r"leaves 1 of the engine's tensors unset, e.g. 'model.norm.weight'"):
        check_against(accepted, partial)


class _OwnNames(BaseModel):
    """Options of an engine whose model names its tensors its own way (as an early adapter template did)."""

    model_config = ConfigDict(extra="forbid")

    def accepts_weights(self, model, weights):
        own = ModelTensors({"embed.weight": ((14, 64), torch.float32)})
        check_against(own, weights)


def test_an_engine_with_other_tensor_names_is_refused_before_the_run():
    pytest.importorskip("asyncflow_fsdp", reason="the fsdp trainer lists the Hugging Face export")
    resolved = resolve(load_config(ARITHMETIC))
    assert check_weight_pairing(resolved) is None  # torch engine + fsdp trainer: they fit
    comp = resolved.components["rollout"]
    resolved.components["rollout"] = dataclasses.replace(comp, options=_OwnNames())
    with pytest.raises(ConfigError, match=r"rollout engine 'torch' would refuse the weights trainer 'fsdp' exports: "
                                          r"'model.embed_tokens.weight' \(and 19 more\) is not a tensor"):
        check_weight_pairing(resolved)


def test_a_rollout_model_other_than_the_trainers_is_refused():
    pytest.importorskip("asyncflow_fsdp", reason="the fsdp trainer lists the Hugging Face export")
    small = ("rollout.options.model={hf_config: {model_type: llama, vocab_size: 14, hidden_size: 32, "
             "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
             "head_dim: 64, tie_word_embeddings: true}}")
    proc = validate(str(ARITHMETIC), small)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert ("rollout engine 'torch' would refuse the weights trainer 'fsdp' exports: model.embed_tokens.weight: "
            "shape (14, 64) does not match the engine's (14, 32)") in proc.stderr
