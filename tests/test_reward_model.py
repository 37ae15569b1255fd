"""Rewards served by models (asyncflow_plugins/rewards_model.py): a small random local reward model and judge.

The scores are meaningless (random weights); the plumbing is real: local
checkpoints loaded by path, batched scoring, timeouts and failing judges
marking samples failed, and a rule-plus-model weighted sum.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import FinishReason, GenerationResult, RewardInput  # noqa: E402
from asyncflow_plugins.hf.testing import TINY_CHAT_QWEN2, build_local_chat_checkpoint  # noqa: E402
from asyncflow_plugins.rewards_model import (  # noqa: E402
    ClassifierReward,
    CombinedConfig,
    CombinedReward,
    JudgeReward,
    ModelRewardConfig,
    parse_verdict,
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    return build_local_chat_checkpoint(tmp_path_factory.mktemp("rm") / "chat")


def _reward_model(chat: Path, out: Path, labels: int) -> Path:
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(chat, local_files_only=True)
    config = transformers.Qwen2Config(vocab_size=len(tok), num_labels=labels, pad_token_id=tok.pad_token_id,
                                      **TINY_CHAT_QWEN2)
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _samples() -> list[RewardInput]:
    return [RewardInput(prompt=f"What is {a} + 1?", completion=f"#### {a + 1}" if a % 2 else "no idea",
                        metadata={"answer": str(a + 1)}) for a in range(5)]


def test_the_model_and_combined_rewards_are_registered():
    names = get_plugin_manager().registrations("reward")
    assert "model" in names and "combined" in names


def test_a_classifier_reward_model_scores_batches_like_one_at_a_time(chat, tmp_path):
    path = _reward_model(chat, tmp_path / "rm", labels=1)
    rm = ClassifierReward(ModelRewardConfig(form="classifier", path=str(path), batch_size=2, replicas=2))
    samples = _samples()
    batched = asyncio.run(rm.score_many(samples, 60.0))
    assert all(ok for ok, _ in batched) and len(batched) == 5
    single = [asyncio.run(rm.score(s)) for s in samples]
    # padding (batch of 2, right-padded) must not change a sequence's score: float32 forward of a 2-layer model
    for (_, b), s in zip(batched, single, strict=True):
        assert math.isclose(b, s, rel_tol=1e-4, abs_tol=1e-4 * (1 + abs(s)))
    assert len({round(v, 6) for _, v in batched}) > 1  # it reads the text: different pairs, different scores
    # the score is the reward model's own: the same as its forward pass on the rendered chat
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    text = tok.apply_chat_template([{"role": "user", "content": samples[0].prompt},
                                    {"role": "assistant", "content": samples[0].completion}], tokenize=False)
    import torch

    with torch.no_grad():
        ref = float(model(**tok(text, return_tensors="pt")).logits[0, 0])
    assert math.isclose(single[0], ref, rel_tol=1e-4, abs_tol=1e-4 * (1 + abs(ref)))


def test_a_reward_model_with_several_labels_is_one_clear_line(chat, tmp_path):
    path = _reward_model(chat, tmp_path / "rm2", labels=2)
    with pytest.raises(ConfigError) as err:
        ClassifierReward(ModelRewardConfig(form="classifier", path=str(path)))
    msg = str(err.value)
    assert "2 output labels" in msg and "num_labels=1" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="no config.json"):
        ClassifierReward(ModelRewardConfig(form="classifier", path=str(tmp_path)))
    with pytest.raises(ValueError, match="needs reward.options.path"):
        ModelRewardConfig(form="classifier")


def test_parse_verdict_takes_the_first_whole_word():
    v = {"yes": 1.0, "no": 0.0}
    assert parse_verdict("Yes, it is.", v) == 1.0
    assert parse_verdict("no. yes", v) == 0.0
    assert parse_verdict("nobody knows; yesterday", v) is None


def test_a_judge_on_a_real_local_engine_answers_every_sample(chat):
    judge = JudgeReward(ModelRewardConfig(form="judge", judge={
        "model_path": str(chat), "engine": "torch", "engine_options": {"device": "cpu", "max_batch": 8},
        "replicas": 2, "max_inflight": 2, "max_new_tokens": 4,
        "template": "Q: {prompt}\nA: {completion}\nReference: {answer}\nCorrect?"}))
    seen = []
    answers = asyncio.run(_with_spy(judge, seen, _samples()))
    assert len(answers) == 5 and {r for r, _ in seen} == {0, 1}  # spread over both replicas, 2 at a time at most
    for ok, value in answers:  # random weights: a verdict or a clear "no verdict", never a hang
        assert (ok and value in (0.0, 1.0)) or (not ok and "no verdict" in value), (ok, value)


async def _with_spy(judge: JudgeReward, seen: list, samples):
    await judge._start()
    for r in judge._pool:
        orig = r.engine.generate

        def spy(reqs, _orig=orig, _i=r.index):
            seen.append((_i, len(reqs)))
            assert len(reqs) <= 2
            return _orig(reqs)

        r.engine.generate = spy
    try:
        return await judge.score_many(samples, 120.0)
    finally:
        await judge.shutdown()


class _Broken:
    """A judge engine that fails (``mode='raise'``) or never answers (``mode='hang'``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.version = 0
        from asyncflow_core.interfaces.features import RolloutFeatures

        self.features = RolloutFeatures()

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def generate(self, requests):
        if self.mode == "raise":
            raise RuntimeError("CUDA error: device lost")
        if self.mode == "hang":
            await asyncio.Event().wait()
        for req in requests:
            yield GenerationResult(req.request_id, req.prompt_token_ids, [5], [0.0], [0], FinishReason.STOP)


@pytest.mark.parametrize("mode, why", [("raise", "judge replica 0 failed: RuntimeError"),
                                       ("hang", "judge timed out after 0.5s")])
def test_a_failing_judge_fails_its_samples_and_does_not_stall(chat, mode, why):
    judge = JudgeReward(ModelRewardConfig(form="judge", judge={"model_path": str(chat), "engine": "torch"}))
    judge._factory = lambda options: _Broken(mode)
    answers = asyncio.run(asyncio.wait_for(judge.score_many(_samples(), 0.5), 30))
    assert all(not ok and why in value for ok, value in answers), answers
    if mode == "raise":  # the replica is dead now: later samples fail at once, with the reason
        again = asyncio.run(judge.score_many(_samples()[:1], 0.5))
        assert not again[0][0] and "every judge replica died" in again[0][1]


def test_rule_plus_model_is_a_weighted_sum_with_each_term_logged(chat, tmp_path):
    path = _reward_model(chat, tmp_path / "rm3", labels=1)
    combo = CombinedReward(CombinedConfig(terms=[
        {"name": "math_verify", "weight": 1.0, "label": "correct", "options": {"fallback": "none"}},
        {"name": "model", "weight": 0.1, "label": "rm", "options": {"form": "classifier", "path": str(path)}},
    ]))
    # every value it returns beside the sum is declared, so each is a store column and a per-step metric
    assert combo.extras == ("correct", "rm", "answer_found")
    out = asyncio.run(combo.score_many(_samples(), 60.0))
    for i, (ok, value) in enumerate(out):
        assert set(value) == {"reward", *combo.extras}
        assert ok and value["correct"] == float(i % 2 == 1) and value["answer_found"] == float(i % 2 == 1)
        assert math.isclose(value["reward"], value["correct"] + 0.1 * value["rm"], rel_tol=1e-9, abs_tol=1e-12)
    with pytest.raises(ConfigError, match="label 'x' is taken"):
        CombinedReward(CombinedConfig(terms=[{"name": "math_verify", "label": "x"},
                                             {"name": "exact_match", "label": "x"}]))
