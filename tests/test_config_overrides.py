"""Dotted overrides that index lists: ``pipeline.stages[0].options.x=3``, with one-line errors for a wrong index."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config import apply_overrides, load_config, parse_override, resolve
from asyncflow_core.errors import ConfigError

REPO = Path(__file__).parents[1]
TOY = REPO / "examples" / "toy_grpo.yaml"
STAGES = "pipeline.stages=[{name: toy_filter}, {name: toy_filter, options: {}}]"


def test_parse_splits_names_and_indices():
    assert parse_override("pipeline.stages[0].options.x=3") == (["pipeline", "stages", 0, "options", "x"], 3)
    assert parse_override("a.b[2][1]=[1, 2]") == (["a", "b", 2, 1], [1, 2])
    assert parse_override("trainer.options.lr=0.001") == (["trainer", "options", "lr"], 0.001)


def test_an_indexed_override_changes_only_that_entry():
    data = {"pipeline": {"stages": [{"name": "a", "options": {"x": 1}}, {"name": "b"}]}}
    out = apply_overrides(data, ["pipeline.stages[0].options.x=3", "pipeline.stages[1].options.y=[1, 2]",
                                 "pipeline.stages[1].name=c"])
    assert out == {"pipeline": {"stages": [{"name": "a", "options": {"x": 3}},
                                           {"name": "c", "options": {"y": [1, 2]}}]}}
    assert data["pipeline"]["stages"][0]["options"]["x"] == 1  # the input is left as it was
    assert apply_overrides({"a": [[0, 1], [2]]}, ["a[0][1]=5"]) == {"a": [[0, 5], [2]]}


def test_an_indexed_override_reaches_the_validated_config():
    cfg = load_config(TOY, ["pipeline.stages=[{name: x}, {name: y, options: {k: 1}}]",
                            "pipeline.stages[1].options.k=3", "pipeline.stages[0].name=z"])
    assert [s.name for s in cfg.pipeline.stages] == ["z", "y"]
    assert cfg.pipeline.stages[1].options == {"k": 3}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("pipeline.stages[2].options.x=3",
         "pipeline.stages[2] is out of range (pipeline.stages has indices 0..1); set the whole list to add entries"),
        ("pipeline.stages[2]={name: x}", "pipeline.stages[2] is out of range"),
        ("pipeline.stages.options.x=3", "pipeline.stages is a list; index it (e.g. pipeline.stages[0].options)"),
        ("seed[0]=1", "seed is 0, not a list; index only a list"),
        ("pipeline.replace[0].name=x", "pipeline.replace is not set, so it has no [0]; set the whole list"),
        ("pipeline.stages[x].name=y", "'stages[x]' is not a field name or name[index]"),
        ("pipeline.stages[-1].name=y", "'stages[-1]' is not a field name or name[index]"),
    ],
)
def test_a_wrong_index_is_one_clear_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(TOY, [STAGES, override])
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_an_empty_list_has_no_indices():
    with pytest.raises(ConfigError, match=r"pipeline.stages\[0\] is out of range \(pipeline.stages has no entries\)"):
        apply_overrides({"pipeline": {"stages": []}}, ["pipeline.stages[0].name=x"])


def test_cli_reports_an_out_of_range_index_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "config", "validate", str(TOY),
                           "pipeline.stages[0].options.x=3"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "pipeline.stages is not set, so it has no [0]" in proc.stderr or "out of range" in proc.stderr


def test_resolved_stage_options_follow_an_indexed_override(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=r"pipeline.stages\[0\].name: no stage named 'toy_filter'"):
        resolve(load_config(TOY, [STAGES, "pipeline.stages[0].options.x=3"]))
