"""Bad input: every user mistake gets one clear error that names what was wrong and how to fix it, and loses no data.

Each case feeds one malformed input to the layer a user reaches it through
and asserts the exception type, that the message names the offending field
or value, and that it hints at the fix. Where data is involved the test also
checks that nothing was lost: a rejected store call leaves the store as it
was, and a run that meets a bad sample accounts for every prompt it admitted
(trained + dropped + unfinished == admitted). docs/reliability.md lists every
case with what the user gets.

Categories: config (``load_config``/``resolve`` and ``asyncflow config
validate`` as a subprocess), dataset rows, reward return values, engine
responses (small *fake* engines defined here), and store calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core.config import RunConfig, load_config, resolve
from asyncflow_core.errors import AsyncflowError, ConfigError, EngineError, UnknownPluginError
from asyncflow_core.flow.runtime import FlowRuntime, run_flow
from asyncflow_core.flow.stage import RunStopped
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.store import (
    ColumnTypeError,
    InvalidRequestError,
    LeaseError,
    StoreFullError,
    UnknownColumnError,
    UnknownRowError,
)
from asyncflow_core.store.inprocess import InProcessStore, InProcessStoreConfig
from asyncflow_core.types import GenerationResult, RaggedTensor
from asyncflow_plugins.toy.rollout import ToyRolloutEngine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "toy_grpo.yaml"
FAST = ["trainer.total_steps=2"]



def toy(*overrides: str):
    return resolve(load_config(EXAMPLE, [*FAST, *overrides]))


def _with_factory(resolved, section: str, factory):
    """The resolved config with ``section`` built by ``factory`` (a fake) instead of its plugin."""
    comp = resolved.components[section]
    record = dataclasses.replace(comp.registered.record, factory=factory)
    resolved.components[section] = dataclasses.replace(comp, registered=dataclasses.replace(comp.registered, record=record))
    return resolved


def _accounted(summary: dict) -> dict:
    led = summary["ledger"]
    assert led["trained"] + led["dropped"] + led["unfinished"] == led["admitted"], led
    return led


def _run_expecting(resolved, exc_type: type[BaseException], run_dir: Path) -> tuple[str, dict]:
    """Run until it raises ``exc_type``; the message and the summary the run still wrote."""
    runtime = FlowRuntime(resolved, run_dir=run_dir, write_png=False)
    with pytest.raises(exc_type) as info:
        asyncio.run(runtime.run())
    return str(info.value), runtime.summary


def _one_line(msg: str) -> None:
    assert "\n" not in msg and "Traceback" not in msg, msg


# ============================================================================================== config

#: (id, overrides on examples/toy_grpo.yaml, substrings the message must contain: the field/value, then the fix)
CONFIG_CASES: list[tuple[str, list[str], list[str]]] = [
    ("unknown-section", ["trainr.total_steps=2"], ["trainr: unknown field", "allowed keys:", "trainer"]),
    ("unknown-key", ["trainer.totl_steps=2"], ["trainer.totl_steps: unknown field", "allowed keys:", "total_steps"]),
    ("wrong-type-int", ["trainer.total_steps=abc"], ["trainer.total_steps", "valid integer", "'abc'"]),
    ("wrong-type-fraction", ["trainer.total_steps=1.5"], ["trainer.total_steps", "fractional part", "1.5"]),
    ("wrong-type-section", ["trainer=5"], ["trainer:", "valid dictionary", "got 5"]),
    ("out-of-range-steps", ["trainer.total_steps=0"], ["trainer.total_steps", "greater than or equal to 1", "got 0"]),
    ("out-of-range-temperature", ["rollout.temperature=0"], ["rollout.temperature", "greater than 0", "got 0"]),
    ("out-of-range-top-p", ["rollout.top_p=1.5"], ["rollout.top_p", "less than or equal to 1", "1.5"]),
    ("top-k-zero", ["rollout.top_k=0"], ["rollout.top_k", "-1 (off) or >= 1"]),
    ("failure-rate-above-1", ["pipeline.max_failure_rate=2"], ["pipeline.max_failure_rate",
                                                               "less than or equal to 1", "got 2"]),
    ("negative-staleness", ["async.max_staleness=-1"], ["async.max_staleness", "greater than or equal to 0", "-1"]),
    ("bad-enum-mode", ["async.mode=fast"], ["async.mode", "'sync', 'one_step' or 'async'", "'fast'"]),
    ("bad-pattern-dtype", ["model.dtype=float8"], ["model.dtype", "float32|bfloat16|float16", "'float8'"]),
    ("bad-pattern-log-level", ["logging.level=LOUD"], ["logging.level", "DEBUG|INFO|WARNING|ERROR", "'LOUD'"]),
    ("sync-with-staleness-2", ["async.mode=sync", "async.max_staleness=2"],
     ["mode sync means max_staleness=0, got 2", "use mode: async"]),
    ("async-without-staleness", ["async.mode=async"], ["mode async needs max_staleness >= 1", "use mode: sync"]),
    ("async-with-staleness-0", ["async.mode=async", "async.max_staleness=0"],
     ["mode async needs max_staleness >= 1", "use mode: sync for 0"]),
    ("colocated-one-step", ["async.colocated=true"], ["colocated: true", "use mode: sync"]),
    ("model-two-sources", ["model.path=/x", "model.hf_config={a: 1}"], ["model.path or model.hf_config, not both"]),
    ("alphabet-repeats", ["model.alphabet=abca"], ["model.alphabet", "repeats 'a'", "give each character once"]),
    ("unknown-rollout-engine", ["rollout.name=nope"], ["rollout.name", "no rollout_engine named 'nope'",
                                                       "available: ", "toy", "asyncflow plugins"]),
    ("unknown-reward", ["reward.name=nope"], ["reward.name", "'nope'", "exact_match"]),
    ("unknown-algorithm", ["algorithm.name=ppx"], ["algorithm.name", "'ppx'", "grpo"]),
    ("unknown-store", ["store.name=nope"], ["store.name", "'nope'", "inprocess"]),
    ("unknown-sampler", ["sampler.name=nope"], ["sampler.name", "'nope'", "group"]),
    ("unknown-transport", ["weight_transport.name=carrier_pigeon"], ["weight_transport.name", "'carrier_pigeon'",
                                                                     "inprocess"]),
    ("unknown-launcher", ["launcher.name=slurm"], ["launcher.name", "'slurm'", "local"]),
    ("unknown-stage", ["pipeline.stages=[{name: nope}]"], ["pipeline.stages[0].name", "no stage named 'nope'"]),
    ("unreplaceable-stage", ["pipeline.replace.rollout={name: x}"], ["'rollout' cannot be replaced",
                                                                     "replaceable: ['reward']"]),
    ("plugin-option-typo", ["rollout.options.vocab_sz=16"], ["rollout.options.vocab_sz: unknown field",
                                                             "allowed keys:", "vocab_size"]),
    ("plugin-option-range", ["rollout.options.vocab_size=-1"], ["rollout.options.vocab_size",
                                                                "greater than or equal to 2", "-1"]),
    ("plugin-option-type", ["algorithm.options.group_size=abc"], ["algorithm.options.group_size", "valid integer",
                                                                  "'abc'"]),
    ("plugin-option-missing", ["data.options={}"], ["data.options.path: required field is missing"]),
    ("reward-option-unknown", ["reward.options.foo=1"], ["reward.options.foo: unknown field", "answer_key"]),
    ("group-size-vs-n", ["algorithm.options.group_size=3"], ["algorithm.options.group_size=3",
                                                             "rollout.n=4", "set group_size to 4"]),
    ("store-capacity-zero", ["store.options.capacity=0"], ["store.options.capacity", "greater than or equal to 1"]),
    ("store-default-sampler", ["store.options.sampler=nope"], ["store.options.sampler", "no sampler named 'nope'",
                                                               "available:", "fifo"]),
    ("template-positional", ["data.options.template='Q {0}'"], ["data.options.template", "positional placeholder",
                                                                "name a field instead"]),
    ("template-unclosed", ["data.options.template='Q {prompt'"], ["data.options.template", "not a valid format string",
                                                                  "'{{' for a literal"]),
    ("arithmetic-operator", ["data.name=arithmetic", "data.options={operators: '/'}"],
     ["data.options.operators", "subset of '+-*'", "'/'"]),
    ("arithmetic-digits", ["data.name=arithmetic", "data.options={min_digits: 3, max_digits: 2}"],
     ["data.options", "min_digits (3) is larger than max_digits (2)"]),
    ("arithmetic-template", ["data.name=arithmetic", "data.options={template: '{expr}='}"],
     ["data.options.template", "'{expression}'", "{expr}"]),
    ("override-no-equals", ["trainer.total_steps"], ["'trainer.total_steps'", "section.field=value"]),
    ("override-no-key", ["=3"], ["'=3'", "section.field=value"]),
    ("override-empty-part", ["trainer..total_steps=3"], ["empty path component", "'trainer..total_steps'"]),
    ("override-bad-yaml", ["trainer.total_steps=[1"], ["'trainer.total_steps=[1'", "not valid YAML"]),
    ("override-into-scalar", ["name.x=1"], ["'name.x=1'", "name is 'toy-grpo'", "not a section"]),
]


@pytest.mark.parametrize("overrides, expected", [pytest.param(o, e, id=i) for i, o, e in CONFIG_CASES])
def test_malformed_config_is_one_clear_config_error(overrides, expected):
    with pytest.raises(ConfigError) as info:
        resolve(load_config(EXAMPLE, overrides))
    msg = str(info.value)
    _one_line(msg)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


_FIELDS = set(RunConfig.model_fields) | {"async"}


@settings(max_examples=25, deadline=None)
@given(key=st.from_regex(r"[a-z][a-z_]{2,12}", fullmatch=True).filter(lambda k: k not in _FIELDS and k != "async_"))
def test_any_unknown_top_level_key_is_named_with_the_allowed_keys(key):
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [f"{key}=1"])
    msg = str(info.value)
    assert f"{key}: unknown field" in msg and "allowed keys: name, seed" in msg


_MIN_ONE = ["trainer.total_steps", "data.prompts_per_step", "rollout.n", "rollout.max_new_tokens", "rollout.replicas",
            "reward.workers", "pipeline.reward_batch"]


@settings(max_examples=25, deadline=None)
@given(field=st.sampled_from(_MIN_ONE), value=st.integers(max_value=0))
def test_any_count_below_one_names_the_field_the_value_and_the_bound(field, value):
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [f"{field}={value}"])
    msg = str(info.value)
    assert field in msg and f"got {value}" in msg and "greater than or equal to 1" in msg


def _bad_file(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "nope.yaml"
    if kind == "directory":
        return tmp_path
    path = tmp_path / "bad.yaml"
    if kind == "not-yaml":
        path.write_text("name: x\nrollout: {name: toy\n")
    elif kind == "top-level-list":
        path.write_text("- name: x\n")
    elif kind == "not-utf8":
        path.write_bytes(b"name: \xff\xfe\n")
    return path


@pytest.mark.parametrize("kind, expected", [
    ("missing", ["does not exist"]),
    ("directory", ["is a directory", "give a YAML file"]),
    ("not-yaml", ["invalid YAML at line", "column"]),
    ("top-level-list", ["top level must be a mapping of sections", "got list"]),
    ("not-utf8", ["cannot read config file"]),
])
def test_bad_config_file_is_one_clear_config_error(tmp_path, kind, expected):
    path = _bad_file(tmp_path, kind)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    _one_line(msg)
    assert str(path.name) in msg or str(path) in msg
    for part in expected:
        assert part in msg


def test_store_capacity_below_the_bound_is_refused_before_anything_is_written(tmp_path):
    msg, _ = _run_expecting(toy("store.options.capacity=8"), ConfigError, tmp_path / "run")
    assert "store.options.capacity=8" in msg and "raise it to at least 48" in msg
    assert not (tmp_path / "run").exists()


def test_inline_reward_forced_where_the_environment_owns_the_reward_is_refused(tmp_path):
    resolved = resolve(load_config(ROOT / "examples" / "agent_guess.yaml", [*FAST, "reward.inline=true"]))
    msg, _ = _run_expecting(resolved, ConfigError, tmp_path / "run")
    _one_line(msg)
    assert "reward.inline: true, but the episodes write the reward" in msg and "null (auto) or false" in msg


# -- the CLI: exit code 2, one line on stderr, never a traceback ---------------------------------------

CLI_CASES: dict[str, tuple[list[str], str]] = {
    "unknown-key": (["trainer.totl_steps=2"], "trainer.totl_steps: unknown field"),
    "contradictory-async": (["async.mode=sync", "async.max_staleness=3"], "mode sync means max_staleness=0, got 3"),
    "unknown-plugin": (["rollout.name=nope"], "no rollout_engine named 'nope'"),
    "bad-plugin-option": (["algorithm.options.group_size=abc"], "algorithm.options.group_size"),
    "bad-override": (["trainer.total_steps"], "must look like section.field=value"),
    "missing-file": ([], "does not exist"),
    "not-yaml": ([], "invalid YAML"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every CLI case started at once (each is a fresh interpreter), then collected."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "bad.yaml").write_text("name: x\nrollout: {name: toy\n")
    procs = {}
    for case, (overrides, _) in CLI_CASES.items():
        file = {"missing-file": tmp / "nope.yaml", "not-yaml": tmp / "bad.yaml"}.get(case, EXAMPLE)
        procs[case] = subprocess.Popen([sys.executable, "-m", "asyncflow_core", "config", "validate", str(file),
                                        *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[case] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_config_validate_exits_2_with_one_line(cli_results, case):
    proc = cli_results[case]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert CLI_CASES[case][1] in lines[0]


# ============================================================================================ datasets

GOOD_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]


def _jsonl(tmp_path: Path, bad_line: str | None, *, at: int = 3) -> Path:
    lines = [json.dumps(r) for r in GOOD_ROWS]
    if bad_line is not None:
        lines.insert(at, bad_line)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


#: rejected while the dataset is read, before the run writes anything: (id, bad line, extra overrides, message parts)
DATASET_AT_START = [
    ("missing-prompt-field", json.dumps({"question": "1+1=", "answer": "2"}), [],
     ["data.jsonl:4", "no field 'prompt'", "data.options.prompt_key", "available fields: 'question'"]),
    ("null-prompt", json.dumps({"prompt": None, "answer": "2"}), [], ["data.jsonl:4", "'prompt' is empty (null)"]),
    ("non-text-prompt", json.dumps({"prompt": 5, "answer": "2"}), [],
     ["data.jsonl:4", "'prompt' is int, not text", "build the prompt with a template"]),
    ("not-json", "{not json", [], ["data.jsonl:4", "not valid JSON"]),
    ("not-an-object", "[1, 2]", [], ["data.jsonl:4", "expected a JSON object, got list"]),
    ("template-missing-field", None, ["data.options.template='Q {question}'"],
     ["data.jsonl:1", "no field 'question'", "used by data.options.template", "available fields: 'prompt', 'answer'"]),
    ("answer-key-missing", None, ["data.options.answer_key=solution"],
     ["no field 'solution'", "data.options.answer_key", "available fields"]),
]


@pytest.mark.parametrize("bad_line, extra, expected", [pytest.param(b, x, e, id=i) for i, b, x, e in DATASET_AT_START])
def test_bad_dataset_row_is_refused_before_the_run_starts(tmp_path, bad_line, extra, expected):
    data = _jsonl(tmp_path, bad_line)
    msg, _ = _run_expecting(toy(f"data.options.path={data}", *extra), ConfigError, tmp_path / "run")
    _one_line(msg)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_empty_dataset_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    msg, _ = _run_expecting(toy(f"data.options.path={path}"), ConfigError, tmp_path / "run")
    assert "the dataset is empty" in msg and "point data.options at a file with prompts" in msg


def test_missing_dataset_file_is_refused(tmp_path):
    msg, _ = _run_expecting(toy(f"data.options.path={tmp_path / 'nope.jsonl'}"), ConfigError, tmp_path / "run")
    assert "data.options.path" in msg and "nope.jsonl" in msg and "is not a file" in msg


def test_parquet_without_the_prompt_column_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "x.parquet")
    msg, _ = _run_expecting(toy("data.name=parquet", f"data.options.path={tmp_path / 'x.parquet'}"), ConfigError,
                            tmp_path / "run")
    assert "x.parquet" in msg and "no field 'prompt'" in msg and "available fields: 'question', 'answer'" in msg


#: found when the feeder tokenizes the prompt, mid-run: the run stops and what it did is accounted for
DATASET_MID_RUN = [
    ("empty-prompt", json.dumps({"prompt": "", "answer": "1"}), [], RunStopped,
     ["dataset record 0 has an empty prompt", "remove it or give it text"]),
    ("outside-alphabet", json.dumps({"prompt": "WHAT?", "answer": "1"}), [], ConfigError,
     ["dataset record 0", "'WHAT?'", "'W'", "not in model.alphabet", "extend the alphabet"]),
]


@pytest.mark.parametrize("bad_line, extra, exc_type, expected",
                         [pytest.param(b, x, t, e, id=i) for i, b, x, t, e in DATASET_MID_RUN])
def test_bad_prompt_found_mid_run_stops_with_the_reason_and_accounts(tmp_path, bad_line, extra, exc_type, expected):
    data = _jsonl(tmp_path, bad_line, at=0)
    msg, summary = _run_expecting(toy(f"data.options.path={data}", "data.shuffle=false", *extra), exc_type,
                                  tmp_path / "run")
    _one_line(msg)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    _accounted(summary)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ledger"] == summary["ledger"]


def test_a_prompt_beyond_the_engine_vocabulary_fails_only_its_own_rows(tmp_path):
    """The engine answers that request with an error result: its rows are recorded as failed, the run goes on."""
    data = _jsonl(tmp_path, json.dumps({"prompt": "xyz", "answer": "1"}), at=0)
    runtime = FlowRuntime(toy(f"data.options.path={data}", "data.shuffle=false"), run_dir=tmp_path / "run",
                          write_png=False)
    asyncio.run(runtime.run())
    summary = runtime.summary
    assert summary["stop_reason"] == "done", summary["stop_reason"]
    assert summary["counters"]["failed_rollout"] > 0
    led = _accounted(summary)
    assert led["dropped"] > 0


def test_arithmetic_prompts_outside_the_alphabet_name_the_record_and_character(tmp_path):
    msg, _ = _run_expecting(toy("data.name=arithmetic", "data.options={size: 8, operators: '*'}",
                                "model.alphabet='0123456789+-=.'"), ConfigError, tmp_path / "run")
    assert "dataset record" in msg and "'*'" in msg and "model.alphabet '0123456789+-=.'" in msg
    assert "extend the alphabet" in msg


# ============================================================================================= rewards


class _BadReward:
    """A reward plugin stand-in returning ``value`` for the prompts ``bad`` says (a callable: its result or its raise)."""

    needs_text = True

    def __init__(self, value: Any, only: str | None = None) -> None:
        self.value = value
        self.only = only

    def score(self, sample):
        if self.only is None or sample.prompt == self.only:
            return self.value() if callable(self.value) else self.value
        return 1.0


def _raise():
    raise RuntimeError("reward server said no")


#: (id, what the reward returns, substrings of the failure: plugin name and value, then the fix)
REWARD_CASES = [
    ("nan", float("nan"), ["reward 'exact_match'", "value nan", "not a finite number"]),
    ("inf", float("inf"), ["reward 'exact_match'", "value inf", "not a finite number"]),
    ("string", "abc", ["reward 'exact_match'", "value 'abc'", "must return a float"]),
    ("numeric-string", "1.0", ["reward 'exact_match'", "value '1.0'", "must return a float"]),
    ("none", None, ["reward 'exact_match'", "value None", "must return a float"]),
    ("list", [1.0], ["reward 'exact_match'", "value [1.0]", "must return a float"]),
    ("dict-without-reward", {"score": 1.0}, ["reward 'exact_match'", "without a 'reward' key", "['score']",
                                             "return {'reward': <number>"]),
    ("dict-nan-reward", {"reward": float("nan")}, ["reward 'exact_match'", "value nan", "not a finite number"]),
    ("dict-text-extra", {"reward": 1.0, "note": "hi"}, ["reward 'exact_match'", "extra value 'note'", "'hi'"]),
    ("raises", _raise, ["RuntimeError: reward server said no"]),
]


@pytest.mark.parametrize("value, expected", [pytest.param(v, e, id=i) for i, v, e in REWARD_CASES])
def test_bad_reward_for_one_prompt_fails_its_samples_and_the_run_goes_on(tmp_path, value, expected):
    resolved = _with_factory(toy("data.shuffle=false"), "reward", lambda cfg: _BadReward(value, only="1+1="))
    summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert summary["steps"] == 2 and summary["stop_reason"] == "done"
    assert summary["counters"]["failed_reward"] >= 4  # the bad prompt's group of 4
    led = _accounted(summary)
    assert led["dropped_failed"] >= 1 and led["dropped"] == led["dropped_failed"]


@pytest.mark.parametrize("value, expected", [pytest.param(v, e, id=i) for i, v, e in REWARD_CASES])
def test_bad_reward_everywhere_stops_with_the_failure_rate_message(tmp_path, value, expected):
    resolved = _with_factory(toy(), "reward", lambda cfg: _BadReward(value))
    msg, summary = _run_expecting(resolved, RunStopped, tmp_path)
    _one_line(msg)
    assert "pipeline.max_failure_rate=0.2" in msg and "stage 'reward'" in msg and "raise the limit" in msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert summary["steps"] == 0  # nothing poisoned reached the trainer
    _accounted(summary)


def test_finite_numbers_of_every_kind_are_accepted_as_rewards(tmp_path):
    """The control: ints, bools, numpy-style and one-element tensor rewards are numbers, not failures."""
    values = iter([1, True, 0.5, torch.tensor(0.25)] * 1000)
    resolved = _with_factory(toy(), "reward", lambda cfg: _BadReward(lambda: next(values)))
    summary = run_flow(resolved, run_dir=tmp_path, write_png=False)
    assert summary["steps"] == 2 and "failed_reward" not in summary["counters"]


# ===================================================================================== engine responses
# The engines below are FAKES for this test only: each wraps the toy engine (a RolloutEngine) and corrupts
# its results in one way, the way a buggy adapter would.


class _FakeOutOfVocabEngine(ToyRolloutEngine):
    """Fake: every generated token id is 99, outside the toy vocabulary of 16."""

    async def generate(self, requests):
        async for res in super().generate(requests):
            yield dataclasses.replace(res, token_ids=[99] * len(res.token_ids))


class _FakeMisalignedEngine(ToyRolloutEngine):
    """Fake: one log-prob more than tokens (the result type refuses to be built)."""

    async def generate(self, requests):
        async for res in super().generate(requests):
            yield GenerationResult(res.request_id, res.prompt_token_ids, list(res.token_ids),
                                   [*list(res.logprobs), 0.0], list(res.versions), res.finish_reason)


class _FakeWrongIdEngine(ToyRolloutEngine):
    """Fake: answers row 0's request under an id nobody sent."""

    async def generate(self, requests):
        async for res in super().generate(requests):
            if res.request_id.startswith("row0-"):
                res = dataclasses.replace(res, request_id="bogus-1")
            yield res


def test_engine_token_ids_outside_the_vocab_stop_the_run_with_an_engine_error(tmp_path):
    msg, summary = _run_expecting(_with_factory(toy(), "rollout", _FakeOutOfVocabEngine), EngineError, tmp_path)
    _one_line(msg)
    assert "train engine ToyTrainEngine failed on step 0" in msg and "outside the vocabulary [0, 16)" in msg
    assert "share a vocabulary" in msg
    _accounted(summary)


def test_engine_logprobs_of_the_wrong_length_stop_the_run_with_the_lengths(tmp_path):
    msg, summary = _run_expecting(_with_factory(toy(), "rollout", _FakeMisalignedEngine), RunStopped, tmp_path)
    _one_line(msg)
    assert "every rollout replica died" in msg and "must be aligned, got lengths 1, 2, 1" in msg
    _accounted(summary)


@pytest.mark.parametrize("mode", ["sync", "one_step"])
def test_engine_answering_an_unknown_request_id_fails_that_row_instead_of_hanging(tmp_path, mode):
    resolved = _with_factory(toy(f"async.mode={mode}"), "rollout", _FakeWrongIdEngine)
    summary = asyncio.run(asyncio.wait_for(FlowRuntime(resolved, run_dir=tmp_path, write_png=False).run(), 60))
    assert summary["steps"] == 2
    assert summary["counters"]["failed_rollout"] == 1
    led = _accounted(summary)
    assert led["dropped_failed"] == 1


def test_engine_answering_only_unknown_ids_stops_with_the_contract_in_the_message(tmp_path):
    class _FakeAllWrongIds(ToyRolloutEngine):
        """Fake: every result carries a made-up request id."""

        async def generate(self, requests):
            async for res in super().generate(requests):
                yield dataclasses.replace(res, request_id="bogus-" + res.request_id)

    msg, summary = _run_expecting(_with_factory(toy(), "rollout", _FakeAllWrongIds), RunStopped, tmp_path)
    _one_line(msg)
    assert "stage 'rollout'" in msg and "without a result" in msg and "unknown request ids ['bogus-row" in msg
    assert "exactly one result with its own request_id" in msg
    _accounted(summary)


# =============================================================================================== store


def _store() -> InProcessStore:
    async def build() -> InProcessStore:
        s = InProcessStore(InProcessStoreConfig(capacity=16))
        await s.register_task("feeder", produces=("x", "ids"))
        await s.register_task("t", consumes=("x",), produces=("y",))
        await s.put({"x": torch.arange(3, dtype=torch.float32)})
        return s

    return asyncio.run(build())


async def _snapshot(s: InProcessStore) -> tuple[dict, list[float]]:
    stats = await s.stats()
    data = (await s.get(BatchMeta(row_ids=torch.arange(3), columns=("x",))))["x"].tolist()
    return stats, data


async def _lease(s: InProcessStore) -> BatchMeta:
    return await s.get_meta("t", ["x"], 3)


def _ragged(n: int) -> RaggedTensor:
    return RaggedTensor.from_lengths(torch.zeros(n), torch.ones(n, dtype=torch.int64))


#: (id, the bad call on a store holding rows 0..2 of float column x, the error type, message parts)
STORE_CASES: list[tuple[str, Any, type, list[str]]] = [
    ("mismatched-row-counts", lambda s: s.put({"x": torch.zeros(3), "ids": torch.zeros(2)}), ColumnTypeError,
     ["column 'ids' holds 2 rows but 3 rows", "one value (or sequence) per row"]),
    ("wrong-dtype", lambda s: s.put({"x": torch.zeros(3, dtype=torch.int64)}), ColumnTypeError,
     ["column 'x' was first written as dense float32", "dense int64", ".to(torch.float32)"]),
    ("dense-then-ragged", lambda s: s.put({"x": _ragged(3)}), ColumnTypeError,
     ["column 'x' was first written as dense", "this write is ragged", "another column name"]),
    ("wrong-trailing-shape", lambda s: s.put({"x": torch.zeros(3, 2)}), ColumnTypeError,
     ["column 'x'", "trailing shape (2,)", "another column name"]),
    ("python-list-column", lambda s: s.put({"x": [1.0, 2.0]}), ColumnTypeError,
     ["column 'x'", "got list", "torch.tensor(...)"]),
    ("scalar-column", lambda s: s.put({"x": torch.tensor(1.0)}), ColumnTypeError,
     ["0-d tensor", "reshape(1)"]),
    ("no-columns", lambda s: s.put({}), InvalidRequestError, ["needs at least one column"]),
    ("unknown-column-leased", lambda s: s.get_meta("t", ["nope"], 1), UnknownColumnError,
     ["['nope']", "produced columns: ['ids', 'x', 'y']", "fix the column name"]),
    ("never-written-column", lambda s: s.get(BatchMeta(row_ids=torch.arange(3), columns=("ids",))),
     UnknownColumnError, ["column 'ids' was never written", "written columns: ['x']"]),
    ("get-unknown-rows", lambda s: s.get(BatchMeta(row_ids=torch.tensor([1, 99]), columns=("x",))), UnknownRowError,
     ["rows [99]", "never written, or freed", "use the row_ids of a meta"]),
    ("write-unknown-rows", lambda s: s.put({"y": torch.zeros(1)}, rows=BatchMeta(row_ids=torch.tensor([42]))),
     UnknownRowError, ["unknown row ids [42]", "Use the row_ids of a meta"]),
    ("write-repeated-rows", lambda s: s.put({"y": torch.zeros(2)}, rows=BatchMeta(row_ids=torch.tensor([0, 0]))),
     InvalidRequestError, ["row ids repeat", "write each row once"]),
    ("ack-twice", None, LeaseError, ["already acknowledged", "acknowledged or released once"]),
    ("ack-a-put-meta", lambda s: s.ack(BatchMeta(row_ids=torch.arange(3))), LeaseError,
     ["holds no lease", "ack what get_meta() returned"]),
    ("ack-unknown-lease", lambda s: s.ack(BatchMeta(row_ids=torch.arange(1), lease_id=12345)), LeaseError,
     ["lease 12345", "no such lease", "meta that get_meta() returned"]),
    ("unknown-sampler", lambda s: s.get_meta("t", ["x"], 3, sampler="nope"), UnknownPluginError,
     ["no sampler named 'nope'", "available: fifo"]),
    ("unknown-task", lambda s: s.get_meta("nope", ["x"], 3), InvalidRequestError,
     ["unknown task 'nope'", "register_task('nope'"]),
    ("batch-size-zero", lambda s: s.get_meta("t", ["x"], 0), InvalidRequestError,
     ["batch_size must be between 1 and the store's capacity 16", "got 0"]),
    ("put-above-capacity", lambda s: s.put({"x": torch.zeros(17)}, block=False), InvalidRequestError,
     ["cannot put 17 rows into a store of capacity 16", "raise the store's capacity"]),
    ("store-full", lambda s: s.put({"x": torch.zeros(14)}, block=False), StoreFullError,
     ["3 live rows + 14 new > capacity 16", "Acknowledge or clear rows"]),
    ("group-ids-count", lambda s: s.put({"x": torch.zeros(3)}, group_ids=[1, 2]), InvalidRequestError,
     ["group_ids has 2 entries for 3 rows", "one per row"]),
    ("versions-shape", lambda s: s.put({"x": torch.zeros(3)}, versions=torch.tensor([1, 2])), InvalidRequestError,
     ["versions must have shape [3, 2]", "got (2, 2)"]),
    ("negative-timeout", lambda s: s.get_meta("t", ["x"], 1, timeout=-1), InvalidRequestError,
     ["timeout must be >= 0 or None", "got -1"]),
]


async def _ack_twice(s: InProcessStore) -> None:
    meta = await _lease(s)
    await s.ack(meta)
    before = await s.stats()
    try:
        await s.ack(meta)
    finally:
        assert await s.stats() == before


@pytest.mark.parametrize("call, exc_type, expected", [pytest.param(c, t, e, id=i) for i, c, t, e in STORE_CASES])
def test_bad_store_call_raises_a_typed_error_and_changes_nothing(call, exc_type, expected):
    store = _store()

    async def go() -> str:
        if call is None:  # ack twice: the rows are collected after the first ack, so compare around the second
            with pytest.raises(exc_type) as info:
                await _ack_twice(store)
            return str(info.value)
        before = await _snapshot(store)
        with pytest.raises(exc_type) as info:
            await call(store)
        assert await _snapshot(store) == before  # rejected calls leave the store as it was: no lost rows
        return str(info.value)

    msg = asyncio.run(go())
    assert issubclass(exc_type, AsyncflowError)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_bad_default_sampler_is_refused_when_the_store_is_configured():
    with pytest.raises(ValueError, match="no sampler named 'nope'; available: fifo"):
        InProcessStoreConfig(sampler="nope")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_x=st.integers(1, 6), n_y=st.integers(0, 6), ragged=st.booleans())
def test_any_row_count_mismatch_is_refused_and_loses_nothing(n_x, n_y, ragged):
    if n_x == n_y:
        return
    store = _store()

    async def go() -> None:
        before = await _snapshot(store)
        y = _ragged(n_y) if ragged else torch.zeros(n_y)
        with pytest.raises(ColumnTypeError, match=f"holds {n_y} rows but {n_x} rows are being written"):
            await store.put({"x": torch.zeros(n_x), "ids": y})
        assert await _snapshot(store) == before

    asyncio.run(go())


def test_every_error_here_is_an_asyncflow_error():
    """The CLI turns AsyncflowError into one line; the types used above must all be one."""
    for exc in (ConfigError, EngineError, RunStopped, ColumnTypeError, InvalidRequestError, LeaseError, StoreFullError,
                UnknownColumnError, UnknownRowError, UnknownPluginError):
        assert issubclass(exc, AsyncflowError)


class _FakeDyingEngine(ToyRolloutEngine):
    """Fake: every generate call fails after a moment, the way a rollout server that died mid-request does."""

    async def generate(self, requests):
        await asyncio.sleep(0.2)  # the stage has leased every admitted row and waits in the store for more
        raise EngineError("lost the rollout server (fake)")
        yield  # an async generator, as generate() must be


@pytest.mark.timeout(60)
def test_a_sole_replica_dying_while_the_stage_waits_for_rows_stops_the_run(tmp_path):
    """Its requests wait in the stage, not in the store, and count against the feeder's bound: no row will ever
    come, so the stage must see the death and stop the run instead of waiting in the store forever."""
    resolved = _with_factory(toy("async.mode=one_step"), "rollout", _FakeDyingEngine)
    runtime = FlowRuntime(resolved, run_dir=tmp_path, write_png=False)
    with pytest.raises(RunStopped) as info:
        asyncio.run(runtime.run())
    assert "every rollout replica died" in str(info.value) and "lost the rollout server (fake)" in str(info.value)
