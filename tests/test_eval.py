"""Validation pinned to a version (asyncflow_core/flow/eval.py): the queue, the metrics, the scheduler, with fakes."""

from __future__ import annotations

import asyncio
import json
import math
from itertools import combinations
from pathlib import Path

import pytest

from asyncflow_core.config import load_config, resolve
from asyncflow_core.config.models import EvalConfig
from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.eval import (
    EvalPrompt,
    EvalRequests,
    EvalScheduler,
    EvalSet,
    Evaluator,
    load_eval_sets,
    make_round,
    pass_at_k,
    run_pinned,
    set_metrics,
)
from asyncflow_core.flow.telemetry import MetricsWriter
from asyncflow_core.flow.tokenizer import CharTokenizer
from asyncflow_core.types import FinishReason, GenerationResult, PromptRecord, SamplingParams
from asyncflow_plugins.rewards import MathVerify, MathVerifyConfig

ALPHA = "0123456789+-=.# "
TOK = CharTokenizer(ALPHA)


def _set(label: str, answers: list[str]) -> EvalSet:
    prompts = [EvalPrompt(label, i, tuple(TOK.encode(f"{i}+0=")), PromptRecord(i, f"{i}+0=", metadata={"answer": a}))
               for i, a in enumerate(answers)]
    return EvalSet(label, prompts)


def _cfg(**kw) -> EvalConfig:
    return EvalConfig.model_validate({"datasets": [{"options": {"path": "x.jsonl"}}], **kw})


def _result(rid: str, text: str, versions: list[int] | None = None, reason=FinishReason.STOP) -> GenerationResult:
    ids = TOK.encode(text)
    return GenerationResult(rid, (1,), ids, [0.0] * len(ids), versions if versions is not None else [3] * len(ids),
                            reason)


# ------------------------------------------------------------------------------------------------ pass@k


def test_pass_at_k_is_the_unbiased_estimator_checked_by_enumeration():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                correct = [1] * c + [0] * (n - c)
                draws = list(combinations(range(n), k))
                exact = sum(any(correct[i] for i in d) for d in draws) / len(draws)
                assert math.isclose(pass_at_k(n, c, k), exact, rel_tol=0, abs_tol=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_set_metrics_per_prompt_then_mean():
    # prompt 0: 1 of 2 correct; prompt 1: 0 of 2; lengths 2,4,6,8; answer_found 1,1,0,1
    scored = [(0, 1.0, 2, 1.0), (0, 0.0, 4, 1.0), (1, 0.0, 6, 0.0), (1, 0.0, 8, 1.0)]
    m = set_metrics(scored, metrics=["pass@1", "pass@k", "mean_reward", "mean_length", "format_rate"], k=2,
                    threshold=1.0)
    assert m == {"pass@1": 0.25, "pass@2": 0.5, "mean_reward": 0.25, "mean_length": 5.0, "format_rate": 0.75}


# ------------------------------------------------------------------------------------------------ queue


def test_take_gives_eval_work_only_at_the_pinned_version_and_within_the_priority_share():
    q = EvalRequests(SamplingParams(max_new_tokens=4), max_inflight=8, priority=0.25)  # quota 2 per replica
    rnd = q.add(make_round(3, [_set("s", ["1", "2", "3"])], samples_per_prompt=2))
    assert q.take(0, 2, free=8) == []  # weights older than the version asked for: nothing
    assert rnd.version is None
    got = q.take(0, 3, free=8)
    assert len(got) == 2 and rnd.version == 3  # pinned, and capped by the quota
    assert q.take(0, 3, free=8) == []  # its share is in flight
    assert q.take(1, 4, free=8) == []  # another version: never
    assert len(q.take(1, 3, free=1)) == 1  # capped by the replica's free slots
    assert q.hold(0, 3) and q.hold(1, 3) and not q.hold(2, 3)
    assert all(r.request_id.startswith("eval-") and r.sampling.max_new_tokens == 4 for r in got)


def test_a_skipped_version_pins_the_round_to_the_first_version_a_replica_has():
    q = EvalRequests(SamplingParams(), max_inflight=4, priority=1.0)
    rnd = q.add(make_round(2, [_set("s", ["1"])], samples_per_prompt=1))
    assert len(q.take(0, 5, free=4)) == 1 and rnd.version == 5 and rnd.requested == 2


def test_results_of_another_version_are_refused_and_aborts_requeued():
    done = []
    q = EvalRequests(SamplingParams(), max_inflight=4, priority=1.0, on_complete=done.append)
    rnd = q.add(make_round(3, [_set("s", ["1", "2"])], samples_per_prompt=1))
    a, b = q.take(0, 3, free=4)

    async def go():
        await q.result(0, _result(a.request_id, "1", reason=FinishReason.ABORT))
        assert len(rnd.pending) == 1 and q.outstanding  # back in the queue, same version
        assert q.hold(0, 3)  # pending work it was serving: keep the weights
        (a2,) = q.take(0, 3, free=4)
        await q.result(0, _result(a2.request_id, "1", versions=[3]))
        await q.result(0, _result(b.request_id, "22", versions=[3, 4]))  # a token of version 4: refused

    asyncio.run(go())
    assert done == [rnd] and not q.outstanding and not q.hold(0, 3)
    assert list(rnd.results) == [a.request_id] and list(rnd.mismatched) == [b.request_id]


def test_a_dead_replica_requeues_and_an_unserved_version_expires():
    done = []
    q = EvalRequests(SamplingParams(), max_inflight=4, priority=1.0, on_complete=done.append)
    rnd = q.add(make_round(1, [_set("s", ["1", "2"])], samples_per_prompt=1))
    q.take(0, 1, free=4)

    async def go():
        await q.requeue(0)
        assert len(rnd.pending) == 2
        await q.expire(2)  # every live replica is past version 1 now

    asyncio.run(go())
    assert done == [rnd] and len(rnd.failed) == 2 and "version 1" in next(iter(rnd.failed.values()))


# ------------------------------------------------------------------------------------------------ evaluator


class FakeEngine:
    """Answers prompt i with '#### i' (prompt 1 wrong for sample 1); every token at ``version``."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.calls = 0

    async def generate(self, requests):
        self.calls += 1
        for req in requests:
            idx, sample = int(req.request_id.split("-")[-2]), int(req.request_id.split("-")[-1])
            text = f"#### {idx}" if not (idx == 1 and sample == 1) else "9"
            yield _result(req.request_id, text, versions=[self.version] * len(TOK.encode(text)))


def test_a_round_on_a_fake_engine_writes_a_record_tagged_with_the_version(tmp_path):
    cfg = _cfg(samples_per_prompt=2)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    sinks: list = []
    ev = Evaluator(MathVerify(MathVerifyConfig(fallback="none")), TOK, cfg, writer=writer, run_dir=tmp_path,
                   sinks=[lambda step, scalars: sinks.append((step, scalars))])
    q = EvalRequests(SamplingParams(), max_inflight=3, priority=1.0, on_complete=ev.evaluate)
    q.add(make_round(3, [_set("gsm", ["0", "1", "2"])], samples_per_prompt=2))
    engines = [FakeEngine(3), FakeEngine(2)]  # the replica at version 2 gets no eval work
    asyncio.run(run_pinned(engines, q, max_inflight=3))
    writer.close()
    (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["eval_version"] == 3 and engines[1].calls == 0
    assert rec["eval/gsm/samples"] == 6 and rec["eval/gsm/failed"] == 0
    assert math.isclose(rec["eval/gsm/pass@1"], 5 / 6) and rec["eval/gsm/pass@2"] == 1.0
    assert math.isclose(rec["eval/gsm/format_rate"], 5 / 6)
    assert sinks and sinks[0][0] == 3 and "eval/gsm/pass@1" in sinks[0][1]
    assert (tmp_path / "eval.png").stat().st_size > 0


def test_run_pinned_fails_a_round_no_engine_can_serve():
    q = EvalRequests(SamplingParams(), max_inflight=3, priority=1.0)
    q.add(make_round(3, [_set("gsm", ["0"])], samples_per_prompt=1))
    with pytest.raises(ConfigError, match="version"):
        asyncio.run(run_pinned([FakeEngine(1)], q, max_inflight=3))


# ------------------------------------------------------------------------------------------------ scheduler


def test_the_scheduler_asks_for_every_nth_version_the_start_and_the_end():
    q = EvalRequests(SamplingParams(), max_inflight=4, priority=0.5)
    sched = EvalScheduler(_cfg(every_steps=4, at_start=True, at_end=True), [_set("s", ["1"])], q, total_steps=10)
    sched.start()
    for v in range(1, 11):
        sched.ask(v)
    assert sched.asked == [0, 4, 8, 10] and [r.requested for r in q.rounds] == [0, 4, 8, 10]
    quiet = EvalScheduler(_cfg(every_steps=0, at_end=False), [], q, total_steps=10)
    assert not any(quiet.due(v) for v in range(11))


# ------------------------------------------------------------------------------------------------ config, sets


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_sets_load_through_the_dataset_plugin_and_overlap_warns_once(tmp_path, caplog):
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    held = _write(tmp_path / "held.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3, 8)])
    cfg = load_config(data={
        "model": {"alphabet": ALPHA},
        "data": {"options": {"path": str(train), "answer_key": "answer"}},
        "reward": {"name": "math_verify"},
        "eval": {"datasets": [{"options": {"path": str(held), "answer_key": "answer"}}], "every_steps": 5},
    })
    resolved = resolve(cfg)
    from asyncflow_plugins.datasets import JsonlConfig, JsonlDataset

    with caplog.at_level("WARNING", logger="asyncflow.flow"):
        (st,) = load_eval_sets(resolved, TOK, JsonlDataset(JsonlConfig(path=str(train), answer_key="answer")))
    assert st.label == "held" and len(st.prompts) == 5 and st.prompts[0].prompt_ids == tuple(TOK.encode("3+1="))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "2 of its 5 prompts also appear in the training data" in warnings[0]
    assert "\n" not in warnings[0]
    assert resolved.dump()["eval"]["datasets"][0]["options"]["answer_key"] == "answer"


def test_bad_eval_config_is_one_clear_line(tmp_path):
    base = {"reward": {"name": "math_verify"}, "data": {"options": {"path": "x"}}}
    with pytest.raises(ConfigError) as err:
        resolve(load_config(data={**base, "eval": {"datasets": [{"name": "nope", "options": {}}]}}))
    assert "eval.datasets[0].name" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown eval metric 'pass@x'"):
        load_config(data={**base, "eval": {"datasets": [{"options": {"path": "x"}}], "metrics": ["pass@x"]}})
    with pytest.raises(ConfigError, match="eval.priority|priority"):
        load_config(data={**base, "eval": {"datasets": [{"options": {"path": "x"}}], "priority": 0}})


def test_finish_rounds_runs_the_last_round_after_training_and_closes_stale_ones(tmp_path):
    from asyncflow_core.flow.eval import finish_rounds

    done = []
    q = EvalRequests(SamplingParams(), max_inflight=2, priority=0.5, on_complete=done.append)
    old = q.add(make_round(1, [_set("s", ["0"])], samples_per_prompt=1))
    q.take(0, 1, free=2)  # pinned at 1, then the replica died with it in flight
    asyncio.run(q.requeue(0))
    last = q.add(make_round(4, [_set("s", ["0", "1"])], samples_per_prompt=2))
    engine = FakeEngine(3)

    async def load_latest():
        engine.version = 4

    asyncio.run(finish_rounds(q, [engine], max_inflight=2, load_latest=load_latest))
    assert done == [old, last] and len(old.failed) == 1 and len(last.results) == 4 and not q.outstanding


def test_finish_rounds_requeues_requests_cut_off_in_flight_when_training_ended():
    """The last round had requests in flight on a replica when the rollout stage stopped (and cancelled the tasks
    that drove them): after training they are sampled again, so the round finishes with every sample, instead of
    failing the run's final evaluation with "found no engine with those weights"."""
    from asyncflow_core.flow.eval import finish_rounds

    done = []
    q = EvalRequests(SamplingParams(), max_inflight=4, priority=1.0, on_complete=done.append)
    last = q.add(make_round(2, [_set("s", ["0", "1"])], samples_per_prompt=2))
    cut = q.take(0, 2, free=3)  # three of the four in flight at version 2; the stage then stopped
    assert len(cut) == 3 and len(last.pending) == 1
    engine = FakeEngine(2)
    asyncio.run(finish_rounds(q, [engine], max_inflight=4))
    assert done == [last] and len(last.results) == 4 and not last.failed and not q.outstanding
