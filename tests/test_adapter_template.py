"""adapters/_template: copied and renamed as docs/writing-an-adapter.md says, it passes the spec suite as is.

Nothing is pip-installed: the copy gets the ``*.dist-info`` directory that
``pip install -e`` would write (METADATA and the entry points from its own
pyproject.toml), and goes on PYTHONPATH, so asyncflow discovers it through the
real ``asyncflow`` entry-point group in a fresh interpreter.
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
    assert report["features"]["supports_pause_keep"] is False and report["features"]["supports_abort"] is True
    outcomes = {t["name"]: t["outcome"] for t in report["tests"]}
    assert outcomes["test_pause_keep_unsupported_raises_documented_error"] == "passed"
    assert outcomes["test_abort_returns_partial_results_through_generate"] == "passed"
    assert "failed" not in outcomes.values()
    markdown = (tmp_path / "acme.md").read_text()
    assert "## rollout_engine `acme`" in markdown and "| `supports_pause_keep` | no |" in markdown
