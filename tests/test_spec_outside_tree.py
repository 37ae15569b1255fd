"""The suite as an outside author runs it: from a directory outside the repository, no host conftest."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from asyncflow_plugins.hf.rollout import TorchRolloutConfig

REPO = Path(__file__).parents[1]


def clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


#: The torch engine's options for the suite: CPU; the model comes from the suite. Its EOS option is emptied while
#: the engine still has one: the stop contract lets only a request's stop ids end a completion.
TORCH_OPTIONS = {"device": "cpu"}
if "eos_token_ids" in TorchRolloutConfig.model_fields:
    TORCH_OPTIONS["eos_token_ids"] = []


def test_third_party_test_module_is_one_subclass(tmp_path):
    assert REPO not in tmp_path.parents
    (tmp_path / "test_my_backend.py").write_text(
        textwrap.dedent(
            f"""\
            from asyncflow_spec import RolloutEngineSpec, WeightTransportSpec


            class TestMyEngine(RolloutEngineSpec):
                backend = "torch"
                options = {TORCH_OPTIONS!r}


            class TestMyTransport(WeightTransportSpec):
                backend = "inprocess"
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_backend.py"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "skipped" in proc.stdout  # sleep is off for torch: its error path is tested


def test_asyncflow_spec_by_name_serves_a_model_engine_the_suites_model(tmp_path):
    """By plugin name, an engine with a ``model`` option gets the suite's tiny model: the oracle tests run."""
    options = [arg for key, value in TORCH_OPTIONS.items() for arg in ("-o", f"{key}={json.dumps(value)}")]
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "torch", *options, "--json", "torch.json"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = json.loads((tmp_path / "torch.json").read_text())["backends"]
    assert report["options"]["model"]["path"], report["options"]  # the suite's model, as the report shows
    outcomes = {t["nodeid"].rsplit("::", 1)[-1]: t["outcome"] for t in report["tests"]}
    ran = [name for name, outcome in outcomes.items() if outcome == "passed"]
    for name in ("test_update_weights_changes_the_policy_to_the_new_weights",
                 "test_bad_bucket_is_refused_and_keeps_the_old_version", "test_loads_what_the_paired_trainer_exports",
                 "test_logprobs_follow_the_sampling_convention[top_p]",
                 "test_context_limit_caps_the_completion_and_refuses_a_full_prompt"):
        assert name in ran, (name, outcomes.get(name))


def test_asyncflow_spec_command_runs_the_suite_by_plugin_name(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "toy", "--kind", "train_engine", "-o", "vocab_size=8"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout


def test_asyncflow_spec_refuses_unknown_ambiguous_and_invalid_requests(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "no-such-plugin"], cwd=tmp_path, env=clean_env(),
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "no plugin named 'no-such-plugin'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "toy"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1 and "pick one with --kind" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "toy", "--kind", "rollout_engine", "-o", "vocab_size=1"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "--option.vocab_size" in proc.stderr
