"""``asyncflow spec NAME`` without ``--kind``: which kind a name shared by several plugins means.

A dataset named like another plugin (``calculator``, ``guess``: the
environment and the dataset that generates its rows; ``arithmetic``: the
reward and its dataset) is set aside, so the command tests the other kind and
says so in one line; names still ambiguous (``toy``, ``sim``) are one line
naming the kinds and the ``--kind`` to pick; kinds the suite has no tests for
(stores, launchers) are skipped.
"""

from __future__ import annotations

import pytest

from asyncflow_core.cli.main import _spec_kind, main
from asyncflow_core.errors import AsyncflowError, UnknownPluginError
from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_spec import SPEC_CLASSES
from asyncflow_spec.report import load_report


def _kind(name: str) -> PluginKind:
    pm = get_plugin_manager()
    return _spec_kind(name, [k for k in PluginKind if name in pm.registrations(k)], SPEC_CLASSES, pm)


@pytest.mark.parametrize(("name", "kind"), [
    ("calculator", PluginKind.ENVIRONMENT),   # environment + dataset
    ("guess", PluginKind.ENVIRONMENT),        # environment + dataset
    ("arithmetic", PluginKind.REWARD),        # reward + dataset
    ("inprocess", PluginKind.WEIGHT_TRANSPORT),  # store (no spec class) + weight_transport
    ("jsonl", PluginKind.DATASET),            # a dataset alone is still a dataset
    ("grpo", PluginKind.ALGORITHM),
])
def test_a_name_shared_with_a_dataset_or_an_untested_kind_means_the_other_kind(name, kind, capsys):
    assert _kind(name) is kind
    note = capsys.readouterr().err
    others = [k for k in SPEC_CLASSES if k is not kind and name in get_plugin_manager().registrations(k)]
    if others:  # the note says what was chosen and how to test the other one
        assert f"testing the {kind.value} {name!r}" in note and f"--kind {others[0].value}" in note, note
        assert len(note.strip().splitlines()) == 1
    else:
        assert note == ""


@pytest.mark.parametrize(("name", "kinds"), [
    ("toy", "rollout_engine, train_engine"),
    ("sim", "rollout_engine, train_engine, weight_transport, reward, dataset"),
])
def test_names_still_ambiguous_say_the_kinds_and_how_to_pick(name, kinds):
    with pytest.raises(AsyncflowError, match=rf"is registered as {kinds}; pick one with --kind, "
                                             rf"e.g. asyncflow spec {name} --kind "):
        _kind(name)


def test_unknown_and_untestable_names(monkeypatch, capsys):
    with pytest.raises(UnknownPluginError, match="no plugin named 'no-such-plugin'"):
        _kind("no-such-plugin")
    with pytest.raises(AsyncflowError, match="no tests for store or launcher backends"):
        _kind("ray")
    with pytest.raises(SystemExit) as exit_:
        main(["spec", "calculator", "--kind", "environmnet"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "--kind 'environmnet' is not a plugin kind" in err and "environment" in err and "Traceback" not in err


def test_spec_report_of_a_name_shared_by_an_environment_and_a_dataset(tmp_path, monkeypatch, capsys):
    """The audit's case: ``asyncflow spec calculator --report`` tests the environment, no ``--kind`` needed."""
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "calculator.md"
    with pytest.raises(SystemExit) as exit_:
        main(["spec", "calculator", "--report", str(report), "--json", str(tmp_path / "calculator.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 0, err
    assert "testing the environment 'calculator'" in err and "--kind dataset" in err
    assert "## environment `calculator`" in report.read_text()
    (backend,) = load_report(tmp_path / "calculator.json").backends
    assert backend.kind == "environment" and backend.tests and all(t.outcome == "passed" for t in backend.tests)
