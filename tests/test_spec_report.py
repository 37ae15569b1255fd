"""Feature reports of the conformance suite: the pytest plugin, ``asyncflow spec --report`` and the engines matrix."""

import importlib.util
import sys
from pathlib import Path

import pytest

from asyncflow_core.cli.main import main
from asyncflow_plugins.toy.rollout import FEATURES as TOY_ROLLOUT_FEATURES
from asyncflow_spec.report import load_report

pytest_plugins = ["pytester"]

REPO = Path(__file__).parents[1]

SPEC_MODULE = '''
from asyncflow_spec import RolloutEngineSpec, TrainEngineSpec


class TestToyRollout(RolloutEngineSpec):
    backend = "toy"
    options = {"vocab_size": 16}


class TestToyTrain(TrainEngineSpec):
    backend = "toy"
    options = {"vocab_size": 8}


class TestToyTooSmallVocabulary(RolloutEngineSpec):
    """A real misconfiguration: the prompts use an id the engine's vocabulary lacks, so generation fails."""
    backend = "toy"
    options = {"vocab_size": 4}
    prompt_token_ids = (1, 2, 9)


def test_not_from_the_suite():
    pass
'''


def by_class(report, name):
    (found,) = [b for b in report.backends if b.test_class.endswith("::" + name)]
    return found


def test_report_records_declared_features_and_every_outcome(pytester):
    pytester.makepyfile(test_backends=SPEC_MODULE)
    # in a subprocess: an in-process run restores sys.modules afterwards, and torch modules it imported (the
    # optimizer's lazy torch._dynamo) would register their operator libraries a second time in later tests
    result = pytester.runpytest_subprocess(
        "-p", "asyncflow_spec.report", "--spec-only", "--spec-report", "r.md", "--spec-report-json", "r.json",
        "-p", "no:cacheprovider",
    )
    assert result.ret == 1  # the misconfigured class fails
    assert result.parseoutcomes()["deselected"] == 1  # --spec-only: the module's own test is not the suite's
    report = load_report(pytester.path / "r.json")
    assert report.exit_status == 1 and len(report.backends) == 3
    assert all("test_not_from_the_suite" not in t.name for b in report.backends for t in b.tests)

    toy = by_class(report, "TestToyRollout")
    assert (toy.kind, toy.backend, toy.spec_class) == ("rollout_engine", "toy", "RolloutEngineSpec")
    assert toy.features == TOY_ROLLOUT_FEATURES.model_dump(mode="json") and toy.features_source == "instance"
    assert toy.distribution.startswith("asyncflow ")
    tests = {t.name: t for t in toy.tests}
    assert tests["test_sleep_unsupported_raises_documented_error"].features == {"supports_sleep": "forbid"}
    assert tests["test_sleep_unsupported_raises_documented_error"].outcome == "passed"
    assert tests["test_abort_returns_partial_results_through_generate"].features["supports_abort"] == "require"
    skipped = tests["test_abort_unsupported_raises_documented_error"]
    assert skipped.outcome == "skipped" and "supports_abort is True" in skipped.reason
    assert toy.verdicts()["supports_sleep"] == "error-verified" and toy.verdicts()["supports_abort"] == "verified"
    failing = {t.name for t in toy.tests if t.outcome not in ("passed", "skipped")}
    assert not failing, failing  # the toy engine passes the whole rollout suite

    # whatever the suite holds: a test gated on a flag runs exactly when the declaration allows it
    for backend in report.backends:
        for t in backend.tests:
            for flag, gate in t.features.items():
                declared = backend.features[flag]
                off_path = (gate == "require" and not declared) or (gate == "forbid" and declared)
                if off_path:
                    assert t.outcome == "skipped" and flag in t.reason, (backend.test_class, t.name)

    broken = by_class(report, "TestToyTooSmallVocabulary")
    failed = [t for t in broken.tests if t.outcome == "failed"]
    assert failed and all(t.reason for t in failed)
    assert any("ended with error" in t.reason for t in failed)  # the engine answers each request with an error result

    markdown = (pytester.path / "r.md").read_text()
    assert "## rollout_engine `toy`" in markdown and "## train_engine `toy`" in markdown
    assert "| `supports_sleep` | no | `test_sleep_unsupported_raises_documented_error`" in markdown
    assert "**FAILED**" in markdown and "ended with error" in markdown


@pytest.mark.parametrize("where, message", [
    ("missing-dir/r.md", "does not exist; create it or pick another path"),
    (".", "is a directory; give a file name"),
])
def test_spec_refuses_a_report_path_it_cannot_write(tmp_path, monkeypatch, capsys, where, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["spec", "toy", "--kind", "rollout_engine", "--report", where])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --report ") and message in err and len(err.splitlines()) == 1


def load_matrix_script():
    spec = importlib.util.spec_from_file_location("engines_matrix", REPO / "scripts" / "engines_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engines_matrix"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_engines_matrix_runs_what_is_installed_and_says_why_not_for_the_rest(tmp_path):
    matrix = load_matrix_script()
    here = sys.executable
    module = tmp_path / "test_toy_train_spec.py"
    module.write_text("from asyncflow_spec import TrainEngineSpec\n\n\n"
                      "class TestToyTrain(TrainEngineSpec):\n    backend = 'toy'\n    options = {'vocab_size': 8}\n")
    ran = matrix.run_backend(matrix.Backend("train_engine", "toy", tests=str(module), python=here,
                                            where="asyncflow_plugins/toy/train.py"))
    assert ran.status == "ran" and ran.exit_status == 0, ran.detail
    (report,) = ran.reports
    assert report.features["supports_checkpoint"] is True and report.verdicts()["supports_checkpoint"] == "verified"
    missing = matrix.run_backend(matrix.Backend("train_engine", "nope", python=here,
                                                needs=("asyncflow_no_such_adapter",)))
    assert missing.status == "not installed here" and "asyncflow_no_such_adapter" in missing.detail
    no_python = matrix.run_backend(matrix.Backend("rollout_engine", "far", python="/nonexistent/bin/python"))
    assert no_python.status == "not installed here"

    text = matrix.render([ran, missing, no_python])
    assert "| `toy` | `asyncflow_plugins/toy/train.py` | " in text
    assert "| values | checkpoint | hf_export |" in text and "yes ✓" in text
    assert "| `nope` |" in text and "not installed here" in text
    assert "### train_engine `toy`" in text
