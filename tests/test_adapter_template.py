"""adapters/_template: copied and renamed as docs/writing-an-adapter.md says, it passes the spec suite and trains.

Nothing is pip-installed: the copy gets the ``*.dist-info`` directory that
``pip install -e`` would write (METADATA and the entry points from its own
pyproject.toml), and goes on PYTHONPATH, so asyncflow discovers it through the
real ``asyncflow`` entry-point group in a fresh interpreter. The copy then
runs five steps of examples/arithmetic_grpo.yaml as the rollout engine, with
the ``fsdp`` trainer pushing its weights to it every step.
"""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
TEMPLATE = REPO / "adapters" / "_template"


def copy_and_rename(dest: Path, name: str, class_name: str) -> Path:
    """Step 1 of the guide: copy the folder, rename the package, replace myengine / MyEngine everywhere."""
    shutil.copytree(TEMPLATE, dest, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache"))
    (dest / "asyncflow_myengine").rename(dest / f"asyncflow_{name}")
    for path in dest.rglob("*"):
        if path.is_file():
            text = path.read_text()
            renamed = text.replace("myengine", name).replace("MyEngine", class_name)
            if renamed != text:
                path.write_text(renamed)
    return dest


def install_metadata(project: Path) -> None:
    """What ``pip install -e`` leaves on sys.path for entry-point discovery, written from pyproject.toml."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    dist = project / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    groups = meta["entry-points"]
    (dist / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in groups.items())
    )


@pytest.fixture(scope="module")
def acme(tmp_path_factory):
    project = copy_and_rename(tmp_path_factory.mktemp("outside") / "asyncflow-acme", "acme", "Acme")
    install_metadata(project)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    env["PYTHONPATH"] = str(project)
    return project, env


def test_rename_leaves_no_trace_of_the_template(acme):
    project, _ = acme
    leftovers = [p for p in project.rglob("*") if p.is_file() and "myengine" in p.read_text().lower()]
    assert not leftovers
    assert (project / "asyncflow_acme" / "plugin.py").is_file()


def test_renamed_template_passes_the_spec_suite_and_its_own_tests(acme):
    project, env = acme
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout and " passed" in proc.stdout


def test_asyncflow_spec_report_on_the_renamed_template(acme, tmp_path):
    project, env = acme
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "spec", "acme", "--report", "acme.md", "--json", "acme.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = json.loads((tmp_path / "acme.json").read_text())["backends"]
    assert report["backend"] == "acme" and report["distribution"] == "asyncflow-acme 0.1.0"
    assert report["features"]["supports_pause_keep"] is True and report["features"]["supports_sleep"] is False
    outcomes = {t["name"]: t["outcome"] for t in report["tests"]}
    # by plugin name the suite serves the engine its own tiny model: the oracle and weight tests run too
    for name in ("test_abort_returns_partial_results_through_generate",
                 "test_sleep_unsupported_raises_documented_error",
                 "test_update_weights_changes_the_policy_to_the_new_weights",
                 "test_loads_what_the_paired_trainer_exports",
                 "test_held_requests_continue_on_the_new_weights",
                 "test_bad_bucket_is_refused_and_keeps_the_old_version"):
        assert outcomes[name] == "passed", (name, outcomes[name])
    convention = {o for n, o in outcomes.items() if n.startswith("test_logprobs_follow_the_sampling_convention")}
    assert convention == {"passed"}
    assert "failed" not in outcomes.values()
    markdown = (tmp_path / "acme.md").read_text()
    assert "## rollout_engine `acme`" in markdown and "| `supports_pause_keep` | yes |" in markdown
    assert "no spec test exercised it" not in markdown


@pytest.mark.slow
def test_renamed_template_trains_five_steps_of_the_arithmetic_example(acme, tmp_path):
    """The copy serves the example's model; the fsdp trainer's weights reach it at every step and it samples them.

    A step whose samples are all on-policy (staleness 0: the first, and any
    other the timing makes so) must show the engine's behaviour log-probs
    equal to the trainer's (importance ratio 1): the engine holds exactly the
    weights the trainer published.
    """
    project, env = acme
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "run", str(REPO / "examples" / "arithmetic_grpo.yaml"),
         "rollout.name=acme", "rollout.options={}", "trainer.total_steps=5", "data.prompts_per_step=8",
         "trainer.checkpoint_every=100", "--run-dir", str(run_dir), "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["stop_reason"] == "done"
    assert summary["counters"]["weight_updates"] >= 4  # every published version reached the engine
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    on_policy = [m for m in steps if set(m["staleness_histogram"]) == {"0"}]
    assert on_policy and on_policy[0]["step"] == 1
    for m in on_policy:
        # float32 on both sides: the ratio's rounding is ~1e-6; a wrong weight or convention moves it by > 1e-2
        assert abs(m["train/algo/ratio_mean"] - 1.0) < 1e-3, (m["step"], m["train/algo/ratio_mean"])


def test_template_folder_tracks_no_build_artefacts():
    """The template is copied as is: no egg-info, build or cache directories may be part of it."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "adapters/_template", "spec"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    artefacts = [p for p in tracked if any(part.endswith(".egg-info") or part in ("__pycache__", "build", "dist")
                                           for part in Path(p).parts)]
    assert not artefacts
