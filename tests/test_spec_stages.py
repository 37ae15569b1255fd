"""The stage spec against the stage plugins that exist, and against broken stages it must fail.

The plugins: the hook docstring's example (``asyncflow_stages``: the
``length_filter`` every author starts from, executed from the docstring
itself) and the two stages the flow tests register (a filter and a
replacement reward, tests/flow/test_stage_plugins.py). Broken variants of
them show each spec test can fail.
"""

from __future__ import annotations

import textwrap
import types

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from asyncflow_core.flow.stage import Stage, StageOutput
from asyncflow_core.plugins import PluginKind, StageBackend, get_plugin_manager, hookimpl
from asyncflow_core.plugins.hookspec import AsyncflowHookSpecs
from asyncflow_spec import StageSpec
from asyncflow_spec.base import Maker
from flow.test_stage_plugins import FirstTokenFilter, FirstTokenFilterConfig, LengthReward


def docstring_example() -> types.ModuleType:
    """The ``asyncflow_stages`` hook's example, run as the module an author would copy it into."""
    doc = textwrap.dedent(AsyncflowHookSpecs.asyncflow_stages.__doc__ or "")
    code = textwrap.dedent(doc.split("Example::", 1)[1])
    module = types.ModuleType("asyncflow_doc_stage_example")
    exec(compile(code, "<asyncflow_stages docstring>", "exec"), module.__dict__)  # noqa: S102 - our own docstring
    return module


class _NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WritesWrongDtype(FirstTokenFilter):
    """Declares float32 ``first_token`` (the spec class says so) but writes int64."""

    name = "wrong_dtype"

    async def process(self, batch):
        out = await super().process(batch)
        return StageOutput({"first_token": out.columns["first_token"].long()}, drop=out.drop)


class ReadsUndeclared(LengthReward):
    """Reads ``prompt_ids`` without declaring it in ``consumes``."""

    name = "reads_undeclared"

    async def process(self, batch):
        return StageOutput({"reward": batch["response_ids"].lengths.float() + batch["prompt_ids"].lengths.float()})


class MissesAColumn(LengthReward):
    """Declares ``reward`` and ``length`` but writes only ``reward``."""

    name = "misses_a_column"
    produces = ("reward", "length")


class DropMisaligned(FirstTokenFilter):
    """Returns ``drop`` in reverse row order."""

    name = "drop_misaligned"

    async def process(self, batch):
        out = await super().process(batch)
        return StageOutput(out.columns, drop=out.drop.flip(0))


class BadPlaceholder(Stage):
    """Produces an int64 count but keeps the default float32 placeholder for rows that fail."""

    name = "bad_placeholder"
    consumes = ("response_ids",)
    produces = ("response_length",)

    def __init__(self, config=None) -> None:
        pass

    async def process(self, batch):
        return StageOutput({"response_length": batch["response_ids"].lengths.to(torch.int64)})


class GoodPlaceholder(BadPlaceholder):
    """The same stage with a placeholder in its column's dtype."""

    name = "good_placeholder"

    def placeholder(self, batch):
        return {"response_length": torch.zeros(batch.num_rows, dtype=torch.int64)}


STAGES = {
    "first_token_filter": (FirstTokenFilter, FirstTokenFilterConfig),
    "length_reward": (LengthReward, _NoOptions),
    "wrong_dtype": (WritesWrongDtype, FirstTokenFilterConfig),
    "reads_undeclared": (ReadsUndeclared, _NoOptions),
    "misses_a_column": (MissesAColumn, _NoOptions),
    "drop_misaligned": (DropMisaligned, FirstTokenFilterConfig),
    "bad_placeholder": (BadPlaceholder, _NoOptions),
    "good_placeholder": (GoodPlaceholder, _NoOptions),
}


@pytest.fixture(autouse=True)
def stage_plugins(fresh_plugins):
    """Register the example stages as plugins, as their distributions would."""
    module = types.ModuleType("asyncflow_spec_test_stages")

    @hookimpl
    def asyncflow_stages():
        for name, (factory, config) in STAGES.items():
            yield StageBackend(name=name, factory=factory, config_model=config, description=factory.__doc__ or name)

    module.asyncflow_stages = asyncflow_stages
    pm = get_plugin_manager()
    pm.register_module(module, distribution="tests", version="0", name=module.__name__)
    pm.register_module(docstring_example(), distribution="docs", version="0", name="asyncflow_doc_stage_example")
    yield pm


class TestDocstringLengthFilter(StageSpec):
    """The hook docstring's example, with a limit the suite's batch crosses (responses of 1 to 4 tokens)."""

    backend = "length_filter"
    options = {"max_tokens": 2}
    column_dtypes = {"too_long": torch.float32}


class TestFirstTokenFilter(StageSpec):
    backend = "first_token_filter"
    options = {"token": 3}  # the suite's response 1 starts with token 3: one row dropped
    column_dtypes = {"first_token": torch.float32}


class TestLengthReward(StageSpec):
    backend = "length_reward"


class TestPlaceholderInTheColumnsDtype(StageSpec):
    backend = "good_placeholder"
    column_dtypes = {"response_length": torch.int64}


BROKEN = {
    "wrong_dtype": ({"token": 3}, {"first_token": torch.float32},
                    ["test_process_writes_exactly_what_it_declares_from_only_what_it_consumes",
                     "test_runs_in_the_flow_loop_and_writes_every_row"]),
    "reads_undeclared": ({}, {}, ["test_process_writes_exactly_what_it_declares_from_only_what_it_consumes"]),
    "misses_a_column": ({}, {"length": torch.int64},
                        ["test_process_writes_exactly_what_it_declares_from_only_what_it_consumes"]),
    "drop_misaligned": ({"token": 3}, {"first_token": torch.float32}, ["test_a_drop_filters_exactly_the_dropped_rows"]),
    "bad_placeholder": ({}, {"response_length": torch.int64}, ["test_a_failing_row_is_recorded_and_the_others_go_on"]),
}


def outcome(call) -> str:
    """``passed``, ``failed`` (an assertion or ``pytest.fail``) or ``skipped``: what pytest would report."""
    try:
        call()
    except (AssertionError, pytest.fail.Exception):
        return "failed"
    except pytest.skip.Exception:
        return "skipped"
    return "passed"


@pytest.mark.parametrize(("stage", "test"), [(n, t) for n, (_, _, tests) in BROKEN.items() for t in tests])
def test_the_stage_spec_fails_a_broken_stage(stage, test):
    """The spec test written for each way a stage can break fails on a stage broken that way."""
    options, dtypes, _ = BROKEN[stage]
    spec = type(f"Broken_{stage}", (StageSpec,), {"backend": stage, "options": options, "column_dtypes": dtypes})()
    make = Maker(PluginKind.STAGE, stage, options)
    assert outcome(lambda: getattr(spec, test)(make)) == "failed", f"{stage}: {STAGES[stage][0].__doc__}"


def test_the_broken_stages_differ_only_where_they_are_broken():
    """Each broken stage passes the spec tests it is not broken for (so the failures above are the breakage)."""
    for stage, (options, dtypes, expected) in BROKEN.items():
        spec = type(f"Broken_{stage}", (StageSpec,), {"backend": stage, "options": options, "column_dtypes": dtypes})()
        make = Maker(PluginKind.STAGE, stage, options)
        others = [t for t in ("test_declares_its_columns", "test_runs_in_the_flow_loop_and_writes_every_row")
                  if t not in expected]
        for test in others:
            result = outcome(lambda t=test: getattr(spec, t)(make))
            # a stage that writes too few columns cannot run in the loop either; everything else must pass
            assert result == "passed" or stage == "misses_a_column", (stage, test, result)
