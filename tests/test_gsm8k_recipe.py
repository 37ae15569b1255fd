"""The GSM8K recipe: its shipped data, its GPU config, and its CPU stand-in run end to end on a local checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config import load_config, resolve
from asyncflow_core.types import RewardInput
from asyncflow_plugins.rewards import MathVerify, MathVerifyConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
ASYNCFLOW = str(Path(sys.executable).parent / "asyncflow")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_the_shipped_problems_are_what_the_seeded_script_writes(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_gsm8k_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("gsm8k_train.jsonl", "gsm8k_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    train, held = _rows("gsm8k_train.jsonl"), _rows("gsm8k_eval.jsonl")
    assert len(train) == 200 and len(held) == 50
    questions = [r["messages"][-1]["content"] for r in train + held]
    assert len(set(questions)) == 250  # no duplicates, and no eval question in the training set
    verify = MathVerify(MathVerifyConfig(fallback="none"))
    for r in train + held:  # each worked solution ends with '#### <answer>', which math_verify accepts
        assert r["solution"].splitlines()[-1] == f"#### {r['answer']}"
        out = verify.score(RewardInput(prompt=questions[0], completion=r["solution"], metadata=r))
        assert out == {"reward": 1.0, "answer_found": 1.0}
        wrong = verify.score(RewardInput(prompt="", completion=f"#### {int(r['answer']) + 1}", metadata=r))
        assert wrong["reward"] == 0.0


def test_the_gpu_recipe_and_the_cpu_stand_in_validate():
    for name in ("gsm8k_grpo.yaml", "gsm8k_cpu.yaml", "gsm8k_cpu_lora.yaml"):
        resolved = resolve(load_config(ROOT / "examples" / name))
        cfg = resolved.config
        assert cfg.reward.name == "math_verify" and cfg.eval is not None and "eval.datasets[0]" in resolved.components
    gpu = load_config(ROOT / "examples" / "gsm8k_grpo.yaml")
    assert gpu.rollout.name == "vllm" and gpu.trainer.name == "fsdp" and gpu.model.path.endswith("Instruct")


@pytest.mark.slow
def test_the_cpu_stand_in_trains_and_evaluates_checkpoints_pinned_to_their_version(tmp_path):
    pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")
    transformers = pytest.importorskip("transformers")
    from asyncflow_core.flow.final_model import complete_final_model
    from asyncflow_plugins.hf.testing import build_local_chat_checkpoint

    ckpt = tmp_path / "tiny-chat"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_gsm8k_data.py"), "--out", str(tmp_path / "data"),
                    "--checkpoint", str(ckpt)], check=True, capture_output=True)
    assert (ckpt / "tokenizer_config.json").is_file() and build_local_chat_checkpoint  # built by the script
    run = tmp_path / "run"
    overrides = [f"model.path={ckpt}", "trainer.total_steps=2", "trainer.checkpoint_every=1",
                 "data.prompts_per_step=2", "eval.datasets[0].max_prompts=4", "rollout.max_new_tokens=8",
                 "eval.max_new_tokens=8", "eval.every_steps=1"]
    done = subprocess.run([ASYNCFLOW, "run", "examples/gsm8k_cpu.yaml", *overrides, "--run-dir", str(run),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # during training: an evaluation pinned to each published version, on the rollout replicas, in metrics.jsonl
    during = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_version" in r]
    assert sorted(r["eval_version"] for r in during) == [1, 2], during
    assert all(r["eval/version_mismatch"] == 0 and r["eval/gsm8k/samples"] + r["eval/gsm8k/failed"] == 8
               for r in during)

    for args, version in (([], 2), (["--checkpoint", "1"], 1)):
        ev = subprocess.run([ASYNCFLOW, "eval", str(run), *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
        assert ev.returncode == 0, ev.stderr[-3000:]
        assert f"eval of version {version}" in ev.stdout and "pass@1" in ev.stdout
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["eval_version"] for r in records] == [2, 1]
    for r in records:
        assert r["eval/gsm8k/samples"] + r["eval/gsm8k/failed"] == 4 * 2  # 4 prompts x samples_per_prompt 2
        assert r["eval/version_mismatch"] == 0 and f"step_{r['eval_version']:06d}" in r["weights"]
        assert 0.0 <= r["eval/gsm8k/pass@1"] <= r["eval/gsm8k/pass@2"] <= 1.0
    assert (run / "eval.png").stat().st_size > 0

    bad = subprocess.run([ASYNCFLOW, "eval", str(run), "--checkpoint", "7"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "has 1, 2" in bad.stderr

    # final_model/: loads with the Auto classes, and its chat template renders the prompts the run trained on
    final = run / "final_model"
    complete_final_model(load_config(run / "config.yaml").model, final)
    model = transformers.AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(final, local_files_only=True)
    src = transformers.AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    for r in _rows("gsm8k_eval.jsonl")[:5]:
        assert tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) == \
            src.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
    gen = transformers.GenerationConfig.from_pretrained(final)
    assert gen.eos_token_id == transformers.GenerationConfig.from_pretrained(ckpt).eos_token_id


@pytest.mark.slow
def test_the_cpu_stand_in_with_lora_syncs_the_adapter_only_and_the_canary_sees_it_arrive(tmp_path):
    """examples/gsm8k_cpu_lora.yaml on the local chat checkpoint: each sync after version 0 carries the adapter
    alone (a few percent of the model's bytes), the canary compares engine and trainer at every step and flags
    none, evaluations stay pinned, and final_model/ is the merged model with the checkpoint's chat template."""
    pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")
    pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    transformers = pytest.importorskip("transformers")
    from asyncflow_core.flow.final_model import complete_final_model

    ckpt = tmp_path / "tiny-chat"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_gsm8k_data.py"), "--out", str(tmp_path / "data"),
                    "--checkpoint", str(ckpt)], check=True, capture_output=True)
    run = tmp_path / "run"
    overrides = [f"model.path={ckpt}", "trainer.total_steps=2", "trainer.checkpoint_every=1",
                 "data.prompts_per_step=2", "eval.datasets[0].max_prompts=4", "rollout.max_new_tokens=8",
                 "eval.max_new_tokens=8", "eval.every_steps=1"]
    done = subprocess.run([ASYNCFLOW, "run", "examples/gsm8k_cpu_lora.yaml", *overrides, "--run-dir", str(run),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stop_reason"] == "done"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "eval_version" not in r]
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # every sync moved exactly the adapter: rank x (in + out) float32 values per targeted projection (on this
    # tiny model that is a quarter of its bytes; at the 0.5B shape 0.89 %, docs/performance.md)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter_bytes = 4 * sum(8 * (m.in_features + m.out_features) for name, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    assert 0 < adapter_bytes < full_bytes
    assert [r["weight_bytes"] for r in steps] == [adapter_bytes] * 2
    checked = [r for r in steps if "canary/mean_abs_dlogp" in r]
    assert checked and all(r["canary/flagged"] == 0 and r["canary/stale"] == 0 for r in checked), checked
    evals = sorted(r["eval_version"] for r in records if "eval_version" in r)
    assert evals == [1, 2] and all(r["eval/version_mismatch"] == 0 for r in records if "eval_version" in r)
    final = run / "final_model"
    complete_final_model(load_config(run / "config.yaml").model, final)
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert not any("lora" in name for name in merged.state_dict())  # merged: a plain model, no adapter layers
    tok = transformers.AutoTokenizer.from_pretrained(final, local_files_only=True)
    r = _rows("gsm8k_eval.jsonl")[0]
    src = transformers.AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) == \
        src.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
