"""docs/config.md is generated from the config models; it must match them."""

from pathlib import Path

from asyncflow_core.config.docgen import render


def test_config_reference_is_current():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert doc == render(), "docs/config.md is stale: run `python -m asyncflow_core.config.docgen > docs/config.md`"
