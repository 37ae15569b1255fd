"""Feature reports: what a backend declares, and what the conformance suite found.

A pytest plugin, loaded with ``-p asyncflow_spec.report``, that records every
test of a spec class (passed, skipped with its reason, failed with its first
line) and writes, at the end of the session, a markdown table and/or a JSON
document per tested backend::

    pytest test_my_engine.py -p asyncflow_spec.report --spec-report report.md --spec-report-json report.json

``asyncflow spec NAME --report report.md --json report.json`` does the same
for an installed plugin. Each report has one row per flag of the backend's
``Features`` model (declared value, the tests that exercise it, what they
found) and one row per spec test.

Which tests exercise which flag is read from the tests themselves: a test
that calls ``require(features, "supports_x")`` checks the feature, one that
calls ``forbid(features, "supports_x")`` checks the documented
``UnsupportedFeatureError``, and any other mention of the flag's name in the
test's source counts as exercising it. The declared values are those of the
backend instance the tests built (``make_backend().features``), so options
that change a backend's capabilities are reported as the tests saw them.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from asyncflow_core.plugins import PluginKind, get_plugin_manager
from asyncflow_spec.base import BackendSpec

Outcome = Literal["passed", "failed", "skipped", "error", "not run"]
Gate = Literal["require", "forbid", "mention"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecTestResult(_Model):
    """One spec test of one backend, as pytest ran it."""

    name: str = Field(description="Test function name, e.g. test_abort_returns_partial_results_through_generate.")
    nodeid: str = Field(description="pytest node id.")
    summary: str = Field(description="First line of the test's docstring: what it checks.")
    features: dict[str, Gate] = Field(
        default_factory=dict,
        description="Flags this test exercises: 'require' (runs only when on), 'forbid' (checks the documented "
        "error when off) or 'mention' (reads the flag otherwise).",
    )
    outcome: Outcome = Field("not run", description="passed, failed, skipped, error (in setup/teardown) or not run.")
    reason: str = Field("", description="Skip reason, or the first line of the failure.")
    duration_s: float = Field(0.0, description="Seconds spent in setup, call and teardown.")


class BackendReport(_Model):
    """Everything the suite found about one backend (one spec class of the session)."""

    kind: str = Field(description="Plugin kind, e.g. rollout_engine.")
    backend: str = Field(description="Registered name of the backend.")
    spec_class: str = Field(description="The spec class the tests came from, e.g. RolloutEngineSpec.")
    test_class: str = Field(description="The subclass that named the backend (node id of the class).")
    distribution: str = Field("", description="Distribution that registered the backend, with its version.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options the backend was built with.")
    features: dict[str, Any] = Field(
        default_factory=dict, description="Declared Features: flag -> value, as the backend under test reported them."
    )
    features_source: Literal["instance", "registration", "none"] = Field(
        "none", description="Where `features` came from: a built instance, the plugin registration, or nowhere."
    )
    feature_help: dict[str, str] = Field(default_factory=dict, description="Each flag's description from its model.")
    tests: list[SpecTestResult] = Field(default_factory=list, description="Every spec test, in collection order.")

    def counts(self) -> dict[str, int]:
        """Number of tests per outcome."""
        out: dict[str, int] = {}
        for t in self.tests:
            out[t.outcome] = out.get(t.outcome, 0) + 1
        return out

    def verdicts(self) -> dict[str, str]:
        """Per flag: ``verified``, ``declared`` (on, no test exercised it), ``error-verified`` (off, its documented
        error checked), ``off`` (off, no test exercised it), ``failed``, or ``value`` (not a boolean flag)."""
        out = {}
        for flag, value in self.features.items():
            tests = [t for t in self.tests if flag in t.features]
            if not isinstance(value, bool):
                out[flag] = "failed" if any(t.outcome in ("failed", "error") for t in tests) else "value"
            elif any(t.outcome in ("failed", "error") for t in tests):
                out[flag] = "failed"
            elif any(t.outcome == "passed" for t in tests):
                # off counts as "its documented error verified" only when a test asserted the refusal (marked
                # ``forbid``); descriptive flags (an environment's ``blocking``) are verified either way
                forbidden = any(t.features.get(flag) == "forbid" and t.outcome == "passed" for t in tests)
                out[flag] = "error-verified" if (not value and forbidden) else "verified"
            else:
                out[flag] = "declared" if value else "off"
        return out


class SpecReport(_Model):
    """A whole session: one entry per tested backend, and pytest's exit status."""

    backends: list[BackendReport] = Field(default_factory=list, description="One report per spec class run.")
    exit_status: int = Field(0, description="pytest's exit status.")


# ----------------------------------------------------------------------------- rendering

_VERDICT_TEXT = {
    "verified": "verified",
    "error-verified": "off: `UnsupportedFeatureError` verified",
    "declared": "declared; no spec test exercised it",
    "off": "off; no spec test exercised it",
    "failed": "**FAILED**",
    "value": "",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "(none)"
    return str(value)


def _result(t: SpecTestResult) -> str:
    if t.outcome == "passed":
        return "passed"
    if t.reason:
        return f"{'**' + t.outcome.upper() + '**' if t.outcome in ('failed', 'error') else t.outcome}: {t.reason}"
    return t.outcome


def summary_line(report: BackendReport) -> str:
    """``7 passed, 3 skipped`` (outcomes in a fixed order)."""
    counts = report.counts()
    order = ("passed", "failed", "error", "skipped", "not run")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k)) or "no tests"


def render_backend(report: BackendReport, *, level: int = 2) -> str:
    """A markdown section for one backend: the feature table, then the test table."""
    h = "#" * level
    lines = [f"{h} {report.kind} `{report.backend}`", ""]
    meta = [f"spec class `{report.spec_class}`", f"tests: {summary_line(report)}"]
    if report.distribution:
        meta.insert(0, f"from {report.distribution}")
    lines += ["; ".join(meta) + ".", ""]
    if report.options:
        lines += [f"Options: `{json.dumps(report.options, sort_keys=True)}`", ""]
    if report.features:
        verdicts = report.verdicts()
        lines += ["| feature | declared | tests | result |", "|---|---|---|---|"]
        for flag, value in report.features.items():
            tests = [t for t in report.tests if flag in t.features]
            names = "<br>".join(f"`{t.name}`" for t in tests) or "—"
            results = [_VERDICT_TEXT[verdicts[flag]]] if verdicts[flag] != "value" else []
            results += [_result(t) for t in tests if t.outcome in ("failed", "error")]
            lines.append(f"| `{flag}` | {_cell(_value(value))} | {names} | {_cell('; '.join(results))} |")
        lines.append("")
    lines += ["| test | checks | features | result |", "|---|---|---|---|"]
    for t in report.tests:
        flags = ", ".join(f + (" (error path)" if g == "forbid" else "") for f, g in t.features.items()) or "core"
        lines.append(f"| `{t.name}` | {_cell(t.summary)} | {_cell(flags)} | {_cell(_result(t))} |")
    lines.append("")
    return "\n".join(lines)


def render_markdown(report: SpecReport, *, title: str | None = None) -> str:
    """The whole report: an optional title, then one section per backend."""
    parts = [f"# {title}\n"] if title else []
    parts += [render_backend(b, level=2 if title else 1) for b in report.backends]
    if not report.backends:
        parts.append("No spec test was collected.\n")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- the pytest plugin


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asyncflow-spec report")
    group.addoption("--spec-report", metavar="FILE.md", default=None,
                    help="Write a markdown feature report of the spec tests run to FILE.md.")
    group.addoption("--spec-report-json", metavar="FILE.json", default=None,
                    help="Write the same report as JSON (asyncflow_spec.report.SpecReport).")
    group.addoption("--spec-only", action="store_true", default=False,
                    help="Deselect every test that does not come from an asyncflow spec class.")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("spec_report") or config.getoption("spec_report_json") or config.getoption("spec_only"):
        config.pluginmanager.register(_Collector(config), "asyncflow-spec-report-collector")


def _spec_class_of(cls: type | None) -> type[BackendSpec] | None:
    """The suite's spec class (e.g. RolloutEngineSpec) a test class derives from, or None."""
    if cls is None or not issubclass(cls, BackendSpec):
        return None
    for base in cls.__mro__:
        if base.__module__.startswith("asyncflow_spec.") and base is not BackendSpec and issubclass(base, BackendSpec):
            return base
    return None


def _feature_model(kind: PluginKind, backend: str) -> type[BaseModel] | None:
    try:
        declared = get_plugin_manager().lookup(kind, backend).record.declared_features
    except Exception:  # noqa: BLE001 - an unknown backend fails in its own tests; the report just has no flags
        return None
    return type(declared) if declared is not None else None


def _gates(source: str, flags: Iterable[str]) -> dict[str, Gate]:
    flags = list(flags)
    calls: dict[str, Gate] = {}
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("require", "forbid"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in flags:
                    calls.setdefault(arg.value, node.func.id)  # type: ignore[arg-type]
    found: dict[str, Gate] = {}
    for flag in flags:
        if flag in calls:
            found[flag] = calls[flag]
        elif re.search(rf"\b{flag}\b", source):
            found[flag] = "mention"
    return found


def _first_line(text: str, limit: int = 240) -> str:
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


class _Collector:
    """Collects outcomes during the session and writes the report files at its end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.reports: dict[str, BackendReport] = {}  # by class node id
        self.by_nodeid: dict[str, SpecTestResult] = {}
        self.class_of: dict[str, str] = {}

    # -- collection

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            cls = getattr(item, "cls", None)
            spec = _spec_class_of(cls)
            if spec is None:
                drop.append(item)
                continue
            keep.append(item)
            self._register(item, cls, spec)
        if config.getoption("spec_only") and drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def _register(self, item: pytest.Item, cls: type, spec: type[BackendSpec]) -> None:
        class_id = item.nodeid.rsplit("::", 1)[0]
        report = self.reports.get(class_id)
        kind = PluginKind(spec.kind)
        if report is None:
            model = _feature_model(kind, cls.backend)
            report = BackendReport(
                kind=kind.value,
                backend=cls.backend,
                spec_class=spec.__name__,
                test_class=class_id,
                options=json.loads(json.dumps(cls.options, default=str)),
                feature_help={n: f.description or "" for n, f in model.model_fields.items()} if model else {},
            )
            self.reports[class_id] = report
        func = getattr(item, "function", None)
        try:
            source = inspect.getsource(func) if func is not None else ""
        except (OSError, TypeError):
            source = ""
        result = SpecTestResult(
            name=getattr(item, "originalname", None) or item.name,
            nodeid=item.nodeid,
            summary=_first_line(inspect.getdoc(func) or "") if func is not None else "",
            features=_gates(source, report.feature_help),
        )
        report.tests.append(result)
        self.by_nodeid[item.nodeid] = result
        self.class_of[item.nodeid] = class_id

    # -- what the tests saw: the features of the instances they built

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> None:
        class_id = self.class_of.get(pyfuncitem.nodeid)
        make = pyfuncitem.funcargs.get("make_backend")
        if class_id is None or make is None or self.reports[class_id].features_source == "instance":
            return None
        report = self.reports[class_id]

        def recording(*args: Any, **kwargs: Any) -> Any:
            backend = make(*args, **kwargs)
            features = getattr(backend, "features", None)
            # only the instance built with the class's own options speaks for the backend
            if isinstance(features, BaseModel) and not args and not kwargs and report.features_source != "instance":
                report.features = features.model_dump(mode="json")
                report.features_source = "instance"
            return backend

        built_with = getattr(make, "options", None)
        if isinstance(built_with, dict):
            # the options the suite built the backend with (a spec class may add its own fixtures, e.g. a model)
            recording.options = built_with  # type: ignore[attr-defined]
            report.options = json.loads(json.dumps(built_with, default=str))
        pyfuncitem.funcargs["make_backend"] = recording
        return None  # the default implementation calls the test with the wrapped fixture

    # -- outcomes

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        result = self.by_nodeid.get(report.nodeid)
        if result is None:
            return
        result.duration_s += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                result.outcome = "skipped"
                result.reason = _skip_reason(report)
            elif report.failed:
                result.outcome = "failed" if report.when == "call" else "error"
                result.reason = _failure_line(report)
            else:
                result.outcome = "passed"
        elif report.when == "teardown" and report.failed and result.outcome != "failed":
            result.outcome = "error"
            result.reason = _failure_line(report)

    # -- writing

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        for report in self.reports.values():
            try:
                found = get_plugin_manager().lookup(report.kind, report.backend)
            except Exception:  # noqa: BLE001 - the failing tests report why; the report must still be written
                continue
            report.distribution = f"{found.distribution} {found.version}".strip()
            declared = found.record.declared_features
            if report.features_source == "none" and declared is not None:
                report.features = declared.model_dump(mode="json")
                report.features_source = "registration"
        full = SpecReport(backends=list(self.reports.values()), exit_status=int(exitstatus))
        md = self.config.getoption("spec_report")
        if md:
            Path(md).write_text(render_markdown(full, title="asyncflow conformance report"))
        js = self.config.getoption("spec_report_json")
        if js:
            Path(js).write_text(full.model_dump_json(indent=2) + "\n")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return _first_line(str(longrepr[2]).removeprefix("Skipped: "))
    return _first_line(str(longrepr))


def _failure_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _first_line(crash.message)
    return _first_line(report.longreprtext.strip().splitlines()[-1] if report.longreprtext.strip() else "")


def load_report(path: str | Path) -> SpecReport:
    """Read a JSON report written by ``--spec-report-json`` (or ``asyncflow spec --json``)."""
    return SpecReport.model_validate_json(Path(path).read_text())


__all__: list[str] = ["BackendReport", "SpecReport", "SpecTestResult", "load_report", "render_backend",
                      "render_markdown", "summary_line"]
