"""TRL's GRPOTrainer and asyncflow on the same model and task, one after the other: samples/s and learning.

Usage (TRL lives in its own environment, so the main one keeps its pins):

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0        # first: the local CPU wheel, not a CUDA build
    .venv-bench/bin/pip install trl pluggy pydantic pyyaml
    OMP_NUM_THREADS=2 .venv-bench/bin/python benchmarks/peers/trl_grpo.py [--steps 300] [--lrs 3e-4,1e-3,3e-3]
        [--trl-defaults] [--no-asyncflow] [--asyncflow-steps N] [--asyncflow-python .venv/bin/python]
        [--out runs/peers] [--json]

The model is the example's (``examples/arithmetic_grpo.yaml``: a Llama with
hidden 64, head_dim 64, 4 heads, 2 KV heads, 2 layers, vocabulary 14, tied
embeddings, initializer_range 0.2, random weights), built from the same
``hf_config`` with ``.`` (id 13) as EOS and pad. The tokenizer is a
character tokenizer over the same alphabet, so token ids are identical. The
prompts are the example's dataset (asyncflow's ``arithmetic``, one-digit
addition, same size and seed) and every completion is scored by asyncflow's
own ``arithmetic`` reward (partial credit 0.5, terminator required) on the
completion's token ids, so both sides reward exactly the same thing.

Per step: 32 prompts x 8 completions (``per_device_train_batch_size=256``,
``num_generations=8``, one generation per optimizer step), at most 3 new
tokens, temperature 1, no KL (``beta=0``), AdamW at a constant learning rate,
gradient clipping at 1.0. By default the loss is matched to the example
(``scale_rewards="none"``: Dr. GRPO advantages; ``loss_type="dapo"``: token
mean over the step, as asyncflow's ``token-mean``; ``entropy_coef=0.02``);
``--trl-defaults`` keeps TRL's own defaults for those three instead.
Activation (gradient) checkpointing, on by default in TRL's GRPO, is off:
asyncflow does not recompute activations, and on this model it only costs.

Both sides report the same figures (:mod:`benchmarks.peers.common`):
samples/s from the start of the first step to the end of the last (start-up
excluded), accuracy (exact match) as the mean of the 5 steps ending at fixed
steps, seconds (from the first step's start) until that mean first reaches
0.5, and the final 5-step accuracy. The asyncflow side is
``benchmarks/e2e_cpu.py --modes one_step`` on the example as shipped, run with
``--asyncflow-python`` (the main environment) after the TRL runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for _p in (str(REPO), str(REPO / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from peers.common import learning_summary  # noqa: E402

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"


def _example() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(EXAMPLE.read_text())


def char_tokenizer(alphabet: str, eos: str) -> Any:
    """A fast tokenizer that maps character i of ``alphabet`` to id i (asyncflow's ``CharTokenizer`` ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(alphabet)}, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, padding_side="left")
    if fast.encode("7+8=", add_special_tokens=False) != [alphabet.index(c) for c in "7+8="]:
        raise RuntimeError("the character tokenizer does not reproduce asyncflow's ids")
    return fast


def build_model(hf: dict[str, Any], eos_id: int, seed: int) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**{**hf, "eos_token_id": eos_id, "pad_token_id": eos_id, "bos_token_id": None})
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    return model


def build_dataset(options: dict[str, Any], rows: int) -> Any:
    from datasets import Dataset

    from asyncflow_plugins.arithmetic import ArithmeticConfig, ArithmeticDataset

    cfg = ArithmeticConfig(**options)
    data = ArithmeticDataset(cfg)
    recs = [data[i] for i in range(min(rows, len(data)))]
    return Dataset.from_list([{"prompt": r.prompt, "answer": r.metadata["answer"],
                               "terminator": r.metadata["terminator"]} for r in recs])


def make_reward(alphabet: str, options: dict[str, Any], log: list[tuple[float, int]]) -> Any:
    """TRL reward function: asyncflow's ``arithmetic`` reward on the completion's ids (the EOS kept)."""
    from asyncflow_core.types import RewardInput
    from asyncflow_plugins.arithmetic import ArithmeticReward, ArithmeticRewardConfig

    reward = ArithmeticReward(ArithmeticRewardConfig(**options))
    n = len(alphabet)

    def arithmetic(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                   answer: list[str], terminator: list[str], **_: Any) -> list[float]:
        out, correct = [], 0.0
        for prompt, ids, ans, term in zip(prompts, completion_ids, answer, terminator, strict=True):
            text = "".join(alphabet[i] if 0 <= i < n else "\ufffd" for i in ids)
            s = reward.score(RewardInput(prompt=prompt, completion=text, completion_token_ids=tuple(ids),
                                         metadata={"answer": ans, "terminator": term}))
            out.append(float(s["reward"]))
            correct += s["correct"]
        log.append((correct / len(out), len(out)))
        return out

    return arithmetic


def run_trl(lr: float, *, steps: int, out: Path, seed: int, trl_defaults: bool) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ex = _example()
    alphabet, eos = ex["model"]["alphabet"], ex["model"]["eos"]
    prompts, n = ex["data"]["prompts_per_step"], ex["rollout"]["n"]
    tok = char_tokenizer(alphabet, eos)
    model = build_model(ex["model"]["hf_config"], alphabet.index(eos), seed)
    dataset = build_dataset(ex["data"]["options"], max(4096, prompts * steps))
    rewards: list[tuple[float, int]] = []
    matched = {} if trl_defaults else {"scale_rewards": "none", "loss_type": "dapo",
                                       "entropy_coef": ex["algorithm"]["options"].get("entropy_coef", 0.0)}
    args = GRPOConfig(
        output_dir=str(out / f"trl-lr{lr:g}"), per_device_train_batch_size=prompts * n, gradient_accumulation_steps=1,
        num_generations=n, max_completion_length=ex["rollout"]["max_new_tokens"], temperature=1.0, beta=0.0,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=seed,
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False, **matched)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.first_start: float | None = None
            self.ends: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if self.first_start is None:
                self.first_start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, Any] | None = None, **__: Any) -> None:
            if logs:
                self.logs.append(dict(logs))

    clock = Clock()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs: keep stdout for the report
        trainer = GRPOTrainer(model=model, reward_funcs=make_reward(alphabet, ex["reward"]["options"], rewards),
                              args=args, train_dataset=dataset, processing_class=tok, callbacks=[clock])
        trainer.train()
    wall = time.perf_counter() - t0
    if len(rewards) != len(clock.ends) or clock.first_start is None:
        raise RuntimeError(f"expected one generation per step: {len(rewards)} reward calls for {len(clock.ends)} steps")
    per_step = [{"step": i + 1, "end_s": end - clock.first_start, "samples": count, "accuracy": acc}
                for i, (end, (acc, count)) in enumerate(zip(clock.ends, rewards, strict=True))]
    entropy = [lg["entropy"] for lg in clock.logs if "entropy" in lg]
    return {"side": "trl", "lr": lr, "trl_defaults": trl_defaults, **learning_summary(per_step),
            "entropy_first": entropy[0] if entropy else None, "entropy_last": entropy[-1] if entropy else None,
            "accuracy_per_step": [s["accuracy"] for s in per_step], "wall_s": wall}


def run_asyncflow(python: str, *, steps: int, out: Path) -> dict[str, Any]:
    cmd = [python, str(REPO / "benchmarks" / "e2e_cpu.py"), "--modes", "one_step", "--steps", str(steps),
           "--out", str(out / "asyncflow"), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the asyncflow run failed (exit {proc.returncode}): {tail[0]}")
    (res,) = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    return {"side": "asyncflow", "lr": None, **res["learning"], "accuracy_per_step": res["accuracy_per_step"],
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="TRL learning rates (comma-separated), one run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-defaults", action="store_true",
                   help="TRL's own scale_rewards / loss_type / entropy_coef instead of the example's")
    p.add_argument("--no-asyncflow", action="store_true", help="run only the TRL side")
    p.add_argument("--asyncflow-steps", type=int, default=None,
                   help="steps of the asyncflow run (default: --steps). Its samples/s is a rate either way; more steps "
                   "show whether it reaches accuracy 0.5 within a time budget (60 s) that --steps 100 (~15 s) ends "
                   "well before")
    p.add_argument("--asyncflow-python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="the interpreter of the environment asyncflow is installed in")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "peers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    try:
        lrs = [float(x) for x in a.lrs.split(",") if x]
    except ValueError:
        p.error(f"--lrs {a.lrs!r}: give numbers separated by commas, e.g. 3e-4,1e-3")
    if a.steps < 1 or not lrs or (a.asyncflow_steps is not None and a.asyncflow_steps < 1):
        p.error("--steps and --asyncflow-steps must be >= 1 and --lrs must name at least one learning rate")
    try:
        import trl
    except ImportError:
        p.error("TRL is not installed in this interpreter: run with .venv-bench/bin/python (see the module docstring)")
    if not a.no_asyncflow and not Path(a.asyncflow_python).is_file():
        p.error(f"--asyncflow-python {a.asyncflow_python}: no such interpreter (or pass --no-asyncflow)")
    results = [run_trl(lr, steps=a.steps, out=a.out, seed=a.seed, trl_defaults=a.trl_defaults) for lr in lrs]
    if not a.no_asyncflow:
        results.append(run_asyncflow(a.asyncflow_python, steps=a.asyncflow_steps or a.steps, out=a.out))
    meta = {"trl": trl.__version__, "steps": a.steps, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if a.json:
        print(json.dumps({"results": results, **meta}))
        return 0
    key_at = next(k for k in results[0] if k.startswith("accuracy_") and k.endswith("_at"))
    at_steps = list(results[0][key_at])
    head = ["side", "lr", "steps", "samples/s", "s to acc 0.5", *(f"acc@{s}" for s in at_steps), "final acc",
            "entropy last", "wall s"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in results:
        s05 = r.get("seconds_to_accuracy_0.5")
        ent = r.get("entropy_last")
        print(" | ".join([r["side"], "-" if r["lr"] is None else f'{r["lr"]:g}', str(r["steps"]),
                          f'{r["samples_per_s"]:.1f}', "-" if s05 is None else f"{s05:.1f}",
                          *(f'{r[key_at].get(s, float("nan")):.2f}' for s in at_steps), f'{r["final_accuracy"]:.2f}',
                          "-" if ent is None else f"{ent:.3f}", f'{r["wall_s"]:.0f}']))
    print(f"TRL {trl.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
