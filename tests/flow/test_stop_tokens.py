"""What ends a completion: the task's end token, listed in every request, and never an answer character.

The arithmetic example's character tokenizer makes token i the character
``alphabet[i]``; a Llama config's default ``eos_token_id`` (2) is then the
digit "2", and an engine stopping on it could never write "2." or "12.".
These tests pin the fix: the terminator "." is the only special id of the
built model and the only stop id of every request, a digit EOS is refused
in one line, and the torch engine continues past "2" and stops at ".".
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncflow_core.config.hf import hf_config
from asyncflow_core.config.loader import load_config, resolve
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.runtime import run_flow
from asyncflow_core.flow.tokenizer import CharTokenizer, stop_token_ids, with_dataset_end
from asyncflow_core.types import FinishReason, GenerationRequest, RewardInput, SamplingParams
from asyncflow_plugins.arithmetic import ArithmeticConfig, ArithmeticDataset, ArithmeticReward, ArithmeticRewardConfig
from asyncflow_plugins.hf.rollout import TorchRolloutConfig, TorchRolloutEngine
from asyncflow_plugins.toy.rollout import ToyRolloutEngine

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"
ALPHABET = "0123456789+-=."
DOT = ALPHABET.index(".")


def example(*overrides: str):
    return load_config(EXAMPLE, list(overrides))


def test_the_example_model_has_only_the_terminator_as_a_special_id():
    cfg = resolve(example()).config
    built = hf_config(cfg.model)
    assert cfg.model.alphabet == ALPHABET
    assert built.eos_token_id == DOT and built.bos_token_id is None and built.pad_token_id is None
    assert stop_token_ids(cfg.model, CharTokenizer(cfg.model.alphabet)) == (DOT,)


def test_without_an_end_token_no_special_id_is_a_character():
    """The Llama default (bos 1, eos 2) is gone even when nothing ends completions but their length."""
    model = example("model.eos=null").model
    built = hf_config(model)
    assert (built.eos_token_id, built.bos_token_id, built.pad_token_id) == (None, None, None)
    assert stop_token_ids(model, CharTokenizer(model.alphabet)) == ()


def test_the_dataset_terminator_becomes_the_end_token():
    model = example("model.eos=null").model
    dataset = ArithmeticDataset(ArithmeticConfig(operators="+", max_digits=1))
    assert with_dataset_end(model, dataset).eos == "."
    other = example("model.alphabet=0123456789+-=.;", "model.eos=;").model
    with pytest.raises(ConfigError, match=r"model.eos ';' differs from the dataset's end marker '\.'"):
        with_dataset_end(other, dataset)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.hf_config.eos_token_id=2", "model.hf_config.eos_token_id=2 is '2', a character of model.alphabet"),
        ("model.hf_config.bos_token_id=1", "model.hf_config.bos_token_id=1 is '1'"),
        ("model.hf_config.pad_token_id=[13, 0]", "model.hf_config.pad_token_id=0 is '0'"),
    ],
)
def test_a_special_id_that_is_an_answer_character_is_refused_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        resolve(example(override))
    assert fragment in str(info.value) and "\n" not in str(info.value)
    # the end token itself may be special
    resolve(example("model.hf_config.eos_token_id=13", "model.hf_config.pad_token_id=13"))


def test_a_digit_end_token_is_refused():
    with pytest.raises(ConfigError, match="model.eos '2' is a digit, which answers use"):
        example("model.eos='2'")


def test_cli_validate_refuses_a_digit_eos_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "config", "validate", str(EXAMPLE),
                           "model.hf_config.eos_token_id=2"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "eos_token_id=2 is '2'" in proc.stderr


# -- the torch engine on the example's model ---------------------------------------------------------------------


def _engine() -> TorchRolloutEngine:
    model = resolve(example()).config.model
    return TorchRolloutEngine(TorchRolloutConfig(model=model, device="cpu", max_batch=512))


def _sampling(max_new_tokens: int = 3) -> SamplingParams:
    model = resolve(example()).config.model
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(model, CharTokenizer(ALPHABET)))


def _ids(text: str) -> tuple[int, ...]:
    return tuple(CharTokenizer(ALPHABET).encode(text))


def _generate(requests: list[GenerationRequest]) -> dict[str, object]:
    async def body():
        engine = _engine()
        await engine.start()
        try:
            return {r.request_id: r async for r in engine.generate(requests)}
        finally:
            await engine.shutdown()

    return asyncio.run(body())


def test_forced_decoding_writes_every_answer_with_a_2():
    """Teacher-forced prefixes: "2." and "12." are whole answers; "2" and "12" are not the end of one."""
    reward = ArithmeticReward(ArithmeticRewardConfig())
    sp = _sampling()
    cases = {
        "two": ("1+1=", "2.", "2"),
        "twelve": ("5+7=", "12.", "12"),
        "two-open": ("1+1=", "2", "2"),
        "twelve-open": ("5+7=", "12", "12"),
    }
    requests = [GenerationRequest(rid, _ids(prompt), sp, _ids(prefix), (0.0,) * len(prefix), (0,) * len(prefix))
                for rid, (prompt, prefix, _) in cases.items()]
    results = _generate(requests)
    for rid in ("two", "twelve"):
        prompt, prefix, answer = cases[rid]
        res = results[rid]
        assert res.finish_reason is FinishReason.STOP and tuple(res.token_ids) == _ids(prefix), rid
        text = CharTokenizer(ALPHABET).decode(res.token_ids)
        score = reward.score(RewardInput(prompt, text, metadata={"answer": answer, "terminator": "."}))
        assert score["correct"] == 1.0, (rid, text)
    for rid in ("two-open", "twelve-open"):
        res = results[rid]
        _, prefix, _ = cases[rid]
        tokens = tuple(res.token_ids)
        assert len(tokens) > len(prefix), f"{rid}: the engine ended the completion at the digit 2"
        assert (res.finish_reason is FinishReason.STOP) == (tokens[-1] == DOT), (rid, tokens, res.finish_reason)


def test_sampled_completions_end_only_at_the_terminator_or_the_length():
    """The probe that found the defect (400 requests, 170 ended at "2"), against the fixed run's requests."""
    sp = _sampling()
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    requests = [GenerationRequest(f"r{i}", _ids(prompts[i % 100]), sp) for i in range(400)]
    results = list(_generate(requests).values())
    assert len(results) == 400
    for res in results:
        tokens = list(res.token_ids)
        if res.finish_reason is FinishReason.STOP:
            assert tokens[-1] == DOT and DOT not in tokens[:-1]
        else:
            assert res.finish_reason is FinishReason.LENGTH and len(tokens) == 3 and DOT not in tokens
    # a random policy writes "2" often; none of those completions may have stopped there
    assert any(_ids("2")[0] in res.token_ids[:-1] for res in results)


# -- the runtime puts the end token in every request ------------------------------------------------------------


class _RecordingToy(ToyRolloutEngine):
    """The toy engine, keeping every request and result it sees."""

    seen: list = []

    async def generate(self, requests):
        async for res in super().generate(requests):
            self.seen.append((next(r for r in requests if r.request_id == res.request_id), res))
            yield res


def test_every_rollout_request_carries_the_end_token_and_completions_end_there(tmp_path):
    _RecordingToy.seen = []
    cfg = load_config(REPO / "examples" / "toy_grpo.yaml", [
        "model.alphabet=0123456789+-=.", "data.name=arithmetic", "data.options={operators: '+', max_digits: 1}",
        "reward.name=arithmetic", "rollout.options.vocab_size=14", "trainer.options.vocab_size=14",
        "rollout.max_new_tokens=3", "data.prompts_per_step=8", "trainer.total_steps=3"])
    resolved = resolve(cfg)
    comp = resolved.components["rollout"]
    record = dataclasses.replace(comp.registered.record, factory=_RecordingToy)
    resolved.components["rollout"] = dataclasses.replace(comp, registered=dataclasses.replace(comp.registered,
                                                                                              record=record))
    summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert summary["stop_reason"] == "done"
    assert _RecordingToy.seen
    assert {tuple(req.sampling.stop_token_ids) for req, _ in _RecordingToy.seen} == {(DOT,)}
    stopped = [res for _, res in _RecordingToy.seen if res.finish_reason is FinishReason.STOP]
    # 96+ completions of up to 3 tokens from a random 14-token bigram policy: some end at "." (P(none) < 1e-8)
    assert stopped and all(list(res.token_ids)[-1] == DOT for res in stopped)
    assert "eos: ." in (tmp_path / "config.yaml").read_text()  # the derived end token is kept for a resume


def test_torch_engine_ignores_the_model_eos_unless_asked():
    """The model's own EOS ends nothing by default: what ends a completion is the request (the spec's contract)."""
    assert TorchRolloutConfig().eos_token_ids == []
    model = resolve(example()).config.model
    engine = TorchRolloutEngine(TorchRolloutConfig(model=model, device="cpu"))

    async def body():
        await engine.start()
        try:
            # the prefix ends with the model's eos ("."), but the request lists no stop id: it goes on
            req = GenerationRequest("r", _ids("1+1="), SamplingParams(max_new_tokens=3), _ids("2."), (0.0, 0.0),
                                    (0, 0))
            return [r async for r in engine.generate([req])]
        finally:
            await engine.shutdown()

    (res,) = asyncio.run(body())
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 3
    assert torch.tensor(list(res.token_ids)).numel() == 3
