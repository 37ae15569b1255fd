"""The rollout spec checks itself: deliberately broken copies of the ``torch`` engine must each fail it.

Each mutant below subclasses the reference engine
(asyncflow_plugins/hf/rollout.py) and breaks one clause of the contract the
way real adapters have: weights verified but never applied, raw log-probs,
versions never bumped, a result yielded twice, aborts lost, and more. One
pytest subprocess runs ``RolloutEngineSpec`` against the unmutated engine and
every mutant (the suite serves each its own tiny model, as by plugin name)
and writes the suite's JSON report; the tests here read it. The target is
every mutant caught, by the test meant for it, and the unmutated engine
passing with no oracle test skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_core.interfaces import KVCachePolicy, PauseMode
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_plugins.hf.rollout import TorchRolloutConfig, TorchRolloutEngine

pytestmark = pytest.mark.slow  # one subprocess runs the suite twelve times (a few minutes on two cores)

#: Options of every engine under test; the suite adds its tiny model. The model's EOS is not a stop token
#: unless a request asks (the stop contract); the option is passed while the engine still has it.
OPTIONS: dict[str, Any] = {"device": "cpu", "torch_threads": 1}
if "eos_token_ids" in TorchRolloutConfig.model_fields:
    OPTIONS["eos_token_ids"] = []


class WeightsNotApplied(TorchRolloutEngine):
    """Checks every bucket and bumps the version, but never copies a tensor into the model."""

    def _copy_weights(self, received):
        return None


class RawLogprobs(TorchRolloutEngine):
    """Samples under temperature / top-k / top-p but returns log_softmax of the raw logits."""

    def _sample(self, seqs, logits):
        tokens, _ = super()._sample(seqs, logits)
        picked = torch.tensor(tokens, device=logits.device).unsqueeze(1)
        return tokens, torch.log_softmax(logits.float(), dim=-1).gather(1, picked).squeeze(1).tolist()


class VersionsNotBumped(TorchRolloutEngine):
    """Loads the new weights but keeps the old version (tokens are tagged with it)."""

    async def _install(self, version, received, kv_cache):
        await super()._install(self._version, received, kv_cache)


class DuplicateResults(TorchRolloutEngine):
    """Yields the first result of every generate() call twice."""

    async def generate(self, requests):
        first = True
        async for result in super().generate(requests):
            yield result
            if first:
                first = False
                yield result


class LostAborts(TorchRolloutEngine):
    """abort() answers with the ids it was given but marks nothing: the requests run on to their end."""

    async def abort(self, request_ids=None):
        if request_ids is None:
            return list(self._active)
        return [rid for rid in dict.fromkeys(request_ids) if rid in self._active]


class StopsOnModelEos(TorchRolloutEngine):
    """Ends completions on the model config's EOS although no request listed it."""

    async def start(self):
        await super().start()
        eos = self._net.config.eos_token_id
        self._eos = frozenset([eos] if isinstance(eos, int) else eos or [])


class IgnoresSeed(TorchRolloutEngine):
    """Draws seeded requests from the engine's shared generator."""

    async def generate(self, requests):
        unseeded = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=None)) for r in requests]
        async for result in super().generate(unseeded):
            yield result


class RaisesOnBadRequest(TorchRolloutEngine):
    """Raises out of generate() for a request it cannot serve, which ends every request of the call."""

    async def generate(self, requests):
        for r in requests:
            problem = self._invalid(r)
            if problem is not None:
                raise ValueError(problem)
        async for result in super().generate(requests):
            yield result


class StaleCacheAfterUpdate(TorchRolloutEngine):
    """Applies an update to held requests but keeps their KV cache from the old weights, whatever was asked."""

    async def update_weights(self, version, buckets, *, kv_cache=KVCachePolicy.RECOMPUTE):
        await super().update_weights(version, buckets, kv_cache=KVCachePolicy.KEEP)


class PauseWaitAborts(TorchRolloutEngine):
    """pause(WAIT) aborts the requests in flight instead of letting them finish."""

    async def pause(self, mode=PauseMode.ABORT):
        await super().pause(PauseMode.ABORT if PauseMode(mode) is PauseMode.WAIT else mode)


class IgnoresContextLimit(TorchRolloutEngine):
    """Generates past the model's max_position_embeddings and serves prompts that fill it."""

    async def start(self):
        await super().start()
        self._max_positions = None


#: mutant -> the spec test written to catch it
MUTANTS: dict[type[TorchRolloutEngine], str] = {
    WeightsNotApplied: "test_update_weights_changes_the_policy_to_the_new_weights",
    RawLogprobs: "test_logprobs_follow_the_sampling_convention[temperature]",
    VersionsNotBumped: "test_update_weights_moves_every_new_token_to_the_new_version",
    DuplicateResults: "test_generate_yields_one_aligned_result_per_request",
    LostAborts: "test_abort_returns_partial_results_through_generate",
    StopsOnModelEos: "test_stop_ids_and_length_are_all_that_end_a_completion",
    IgnoresSeed: "test_same_seed_samples_the_same_tokens",
    RaisesOnBadRequest: "test_a_failing_request_gets_an_error_result_and_the_rest_finish",
    StaleCacheAfterUpdate: "test_held_requests_continue_on_the_new_weights",
    PauseWaitAborts: "test_pause_wait_lets_in_flight_finish_and_holds_new_requests",
    IgnoresContextLimit: "test_context_limit_caps_the_completion_and_refuses_a_full_prompt",
}

#: engine internals the mutants override: if the engine renames one, the mutant would silently be the original
INTERNALS = ("_copy_weights", "_sample", "_install", "_active", "_invalid", "_max_positions", "_eos", "_net")


def spec_class(engine_cls: type[TorchRolloutEngine]) -> type:
    """A ``RolloutEngineSpec`` subclass that builds ``engine_cls`` from the ``torch`` engine's validated options."""
    from asyncflow_spec import RolloutEngineSpec

    class Spec(RolloutEngineSpec):
        backend = "torch"
        options = OPTIONS

        @pytest.fixture
        def make_backend(self, backend_options):
            def make(**overrides):
                config = get_plugin_manager().validate_options(PluginKind.ROLLOUT_ENGINE, "torch",
                                                               {**backend_options, **overrides})
                return engine_cls(config)

            make.options = backend_options  # the suite's oracle reads the model from here
            return make

    return Spec


MODULE = """\
import importlib.util

_spec = importlib.util.spec_from_file_location("spec_mutants_source", {source!r})
_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_source)

TestUnmutated = _source.spec_class(_source.TorchRolloutEngine)
for _mutant in _source.MUTANTS:
    globals()["TestMutant" + _mutant.__name__] = _source.spec_class(_mutant)
"""


def test_the_mutants_override_what_the_engine_has():
    """Every engine internal a mutant replaces exists, so each mutant really differs from the engine."""
    engine = TorchRolloutEngine(TorchRolloutConfig(**OPTIONS, model={"hf_config": {"model_type": "llama"}}))
    missing = [name for name in INTERNALS if not hasattr(engine, name)]
    assert not missing, f"the torch engine no longer has {missing}: update the mutants in this file"


@pytest.fixture(scope="module")
def suite_report(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Run the spec on the unmutated engine and every mutant; ``{class name: {test name: outcome}}``."""
    work = tmp_path_factory.mktemp("mutants")
    (work / "test_mutants.py").write_text(MODULE.format(source=str(Path(__file__).resolve())))
    # each class on its own, except the pairing test's trainer (seconds to start): mutants are caught without it
    skip_pairing = "not (test_loads_what_the_paired_trainer_exports and TestMutant)"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_mutants.py", "-q", "-p", "no:cacheprovider", "-p",
         "asyncflow_spec.report", "--spec-report-json", "report.json", "-k", skip_pairing],
        cwd=work, env=env, capture_output=True, text=True, timeout=1500,
    )
    report = work / "report.json"
    assert report.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    outcomes: dict[str, dict[str, str]] = {}
    for backend in json.loads(report.read_text())["backends"]:
        cls = backend["test_class"].rsplit("::", 1)[-1]
        outcomes[cls] = {t["nodeid"].rsplit("::", 1)[-1]: f"{t['outcome']}: {t['reason']}" for t in backend["tests"]}
    return outcomes


def test_the_unmutated_engine_passes_with_every_oracle_test_run(suite_report):
    """The reference engine passes; the tests that need the oracle or weights ran (none skipped for lack of them)."""
    tests = suite_report["TestUnmutated"]
    bad = {name: outcome for name, outcome in tests.items() if outcome.startswith(("failed", "error"))}
    assert not bad, bad
    for name in ("test_update_weights_changes_the_policy_to_the_new_weights",
                 "test_held_requests_continue_on_the_new_weights", "test_loads_what_the_paired_trainer_exports",
                 "test_context_limit_caps_the_completion_and_refuses_a_full_prompt",
                 *[n for n in tests if n.startswith("test_logprobs_follow_the_sampling_convention")]):
        assert tests[name].startswith("passed"), (name, tests[name])


@pytest.mark.parametrize("mutant", list(MUTANTS), ids=lambda m: m.__name__)
def test_the_suite_catches_the_mutant(suite_report, mutant):
    """The test written for this mutant fails on it (and the suite as a whole fails it)."""
    tests = suite_report[f"TestMutant{mutant.__name__}"]
    failed = sorted(name for name, outcome in tests.items() if outcome.startswith(("failed", "error")))
    assert MUTANTS[mutant] in failed, f"{mutant.__name__}: {mutant.__doc__} Failed tests: {failed}"


def test_every_mutant_is_caught(suite_report):
    """The score: 100 % of the mutants fail the suite."""
    caught = [m.__name__ for m in MUTANTS
              if any(o.startswith(("failed", "error")) for o in suite_report[f"TestMutant{m.__name__}"].values())]
    assert len(caught) == len(MUTANTS), sorted(set(m.__name__ for m in MUTANTS) - set(caught))
