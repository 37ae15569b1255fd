"""Config: YAML + dotted overrides, plugin option validation, one-line errors from the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config import AsyncMode, apply_overrides, load_config, parse_override, resolve
from asyncflow_core.errors import ConfigError

EXAMPLE = Path(__file__).parents[1] / "examples" / "toy_grpo.yaml"
MINIMAL = {"reward": {"name": "exact_match"}, "data": {"options": {"path": str(Path(__file__).parents[1] / "examples/data/toy_prompts.jsonl")}}}


def test_example_config_loads_and_resolves(monkeypatch, fresh_plugins):
    monkeypatch.chdir(EXAMPLE.parents[1])
    resolved = resolve(load_config(EXAMPLE))
    assert resolved.config.async_.k == 1
    assert resolved.components["rollout"].options.vocab_size == 16
    dumped = resolved.dump()
    assert dumped["async"]["mode"] == "one_step"
    assert dumped["trainer"]["options"]["max_grad_norm"] == 1.0  # plugin default filled in


def test_overrides_reach_nested_fields_and_are_parsed_as_yaml():
    cfg = load_config(data=MINIMAL, overrides=["trainer.total_steps=100", "async.mode=async", "async.max_staleness=3",
                                                "rollout.options.vocab_size=32", "rollout.temperature=0.7"])
    assert cfg.trainer.total_steps == 100
    assert cfg.async_.mode is AsyncMode.ASYNC and cfg.async_.k == 3
    assert cfg.rollout.options == {"vocab_size": 32} and cfg.rollout.temperature == 0.7


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["trainer.total_stepz=1"], "trainer.total_stepz: unknown field; allowed keys: name, options, total_steps"),
        (["trainer.total_steps=-3"], "trainer.total_steps: Input should be greater than or equal to 1 (got -3)"),
        (["async.mode=sync", "async.max_staleness=2"], "mode sync means max_staleness=0"),
        (["async.mode=async"], "mode async needs max_staleness >= 1"),
        (["async.mode=fast"], "async.mode: Input should be 'sync', 'one_step' or 'async'"),
        (["rollout.top_k=0"], "top_k must be -1"),
    ],
)
def test_bad_values_name_the_field_value_and_what_is_allowed(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(data=MINIMAL, overrides=overrides)
    assert fragment in str(info.value)


def test_plugin_options_are_validated_by_the_plugin_model(fresh_plugins):
    cfg = load_config(data=MINIMAL, overrides=["rollout.options.vocab_sise=3", "algorithm.options.clip_low=2"])
    with pytest.raises(ConfigError) as info:
        resolve(cfg)
    message = str(info.value)
    assert "rollout.options.vocab_sise: unknown field; allowed keys: vocab_size" in message
    assert "algorithm.options" in message and "clip_low must be < 1" in message


def test_unknown_plugin_in_config_lists_available(fresh_plugins):
    with pytest.raises(ConfigError, match=r"rollout.name: no rollout_engine named 'vlm'; available: .*sim, torch, toy"):
        resolve(load_config(data=MINIMAL, overrides=["rollout.name=vlm"]))


@pytest.mark.parametrize("text", ["novalue", "=3", "a..b=1"])
def test_malformed_overrides(text):
    with pytest.raises(ConfigError):
        parse_override(text)


def test_override_into_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("reward: [\n", "invalid YAML at line"),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("reward: {name: exact_match}\ntrainer: {total_steps: zero}\n", "trainer.total_steps: Input should be a valid integer"),
    ],
)
def test_cli_bad_file_is_one_line_and_non_zero(tmp_path, content, fragment):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "asyncflow_core", "config", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


def test_cli_missing_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "config", "validate", str(tmp_path / "nope.yaml")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_show_prints_resolved_yaml_with_overrides():
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "config", "show", str(EXAMPLE), "trainer.total_steps=7"],
        capture_output=True, text=True, cwd=EXAMPLE.parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    import yaml

    shown = yaml.safe_load(proc.stdout)
    assert shown["trainer"]["total_steps"] == 7 and shown["trainer"]["options"]["lr"] == 0.05
