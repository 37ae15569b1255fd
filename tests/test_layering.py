"""The one-way dependency: core imports no plugin or adapter; the spec imports only core (and test libraries)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_core.config import models

REPO = Path(__file__).parents[1]


def imported_top_levels(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_core_never_imports_plugins_or_adapters():
    below = {"asyncflow_plugins", "asyncflow_fsdp", "asyncflow_vllm", "asyncflow_sglang", "asyncflow_megatron"}
    assert not imported_top_levels(REPO / "asyncflow_core") & below
    # only the `asyncflow spec` command reaches for the (optional) suite, lazily
    outside_cli = {p for p in (REPO / "asyncflow_core").iterdir() if p.is_dir() and p.name != "cli"}
    for folder in outside_cli:
        assert "asyncflow_spec" not in imported_top_levels(folder), folder


def test_spec_imports_only_core_and_test_libraries():
    ours = {n for n in imported_top_levels(REPO / "spec") if n.startswith("asyncflow")}
    assert ours <= {"asyncflow_core", "asyncflow_spec"}, ours


def test_core_modules_load_without_any_plugin_imported():
    code = (
        "import sys, asyncflow_core.config, asyncflow_core.interfaces, asyncflow_core.types, asyncflow_core.cli.main;"
        "bad=[m for m in sys.modules if m.startswith('asyncflow_plugins')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("model", [m for m in vars(models).values() if isinstance(m, type) and issubclass(m, models.StrictModel) and m is not models.StrictModel])
def test_every_config_field_is_described_and_documented(model):
    docs = (REPO / "docs" / "config.md").read_text()
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
        assert f"`{field.alias or name}`" in docs, f"docs/config.md lacks {model.__name__}.{name}"
