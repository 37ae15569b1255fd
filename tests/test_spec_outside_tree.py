"""The suite as an outside author runs it: from a directory outside the repository, no host conftest."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).parents[1]


def clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_third_party_test_module_is_one_subclass(tmp_path):
    assert REPO not in tmp_path.parents
    (tmp_path / "test_my_backend.py").write_text(
        textwrap.dedent(
            """\
            from asyncflow_spec import RolloutEngineSpec, WeightTransportSpec


            class TestMyEngine(RolloutEngineSpec):
                backend = "toy"
                options = {"vocab_size": 8, "seed": 3}


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
    assert " passed" in proc.stdout and "skipped" in proc.stdout  # sleep is off for toy: its error path is tested instead


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
