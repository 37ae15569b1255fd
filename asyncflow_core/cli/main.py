"""``asyncflow``: plugins, config and spec commands.

User mistakes (a bad config, an unknown plugin) print one line to stderr and
exit non-zero; they never show a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from asyncflow_core.errors import AsyncflowError, ConfigError, UnknownPluginError
from asyncflow_core.plugins import PluginKind, get_plugin_manager

app = typer.Typer(
    name="asyncflow",
    help="Asynchronous, streaming RL post-training of LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Show or validate a run config.", no_args_is_help=True)
app.add_typer(config_app, name="config")

# a pipe gets a wide table instead of rich's 80-column fallback
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)


def _features_text(features: Any) -> str:
    if features is None:
        return ""
    parts = []
    for name, value in features.model_dump().items():
        if isinstance(value, bool):
            if value:
                parts.append(name.removeprefix("supports_"))
        elif isinstance(value, (list, tuple)):
            parts.append(f"{name.removeprefix('weight_')}={','.join(map(str, value))}")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts)


@app.command("plugins")
def plugins_cmd(
    kind: Annotated[str | None, typer.Option(help="Only this kind (e.g. rollout_engine).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every discovered plugin: kind, name, distribution and version, features."""
    pm = get_plugin_manager()
    if kind is not None:
        try:
            PluginKind(kind)
        except ValueError:
            raise typer.BadParameter(f"unknown kind {kind!r}; kinds: {', '.join(k.value for k in PluginKind)}") from None
    rows = [r for r in pm.all_registrations() if kind is None or r.kind.value == kind]
    if as_json:
        payload = [
            {
                "kind": r.kind.value,
                "name": r.name,
                "distribution": r.distribution,
                "version": r.version,
                "plugin": r.plugin,
                "description": r.record.description,
                "features": r.record.declared_features.model_dump(mode="json") if r.record.declared_features else None,
            }
            for r in rows
        ]
        print(json.dumps(payload, indent=2))
        return
    table = Table(title="asyncflow plugins", show_lines=False)
    for col in ("kind", "name", "distribution", "features", "description"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            r.kind.value,
            r.name,
            f"{r.distribution} {r.version}",
            _features_text(r.record.declared_features),
            r.record.description,
        )
    out.print(table)
    missing = [k.value for k in PluginKind if not pm.registrations(k)]
    if missing and kind is None:
        out.print(f"[dim]no plugin installed for: {', '.join(missing)}[/dim]")


@config_app.command("show")
def config_show(
    file: Annotated[Path, typer.Argument(help="YAML run config.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.total_steps=100.")] = None,
) -> None:
    """Print the validated config with every default (plugin options included) filled in."""
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.config.redact import redact_config

    resolved = resolve(load_config(file, overrides or []))
    print(yaml.safe_dump(redact_config(resolved.dump()), sort_keys=False), end="")
    for section, why in resolved.unchecked.items():
        err.print(f"note: {section} not checked: {why}")


@config_app.command("validate")
def config_validate(
    file: Annotated[Path, typer.Argument(help="YAML run config.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.total_steps=100.")] = None,
) -> None:
    """Check a config, every plugin's options, and that the rollout engine accepts the trainer's weights.

    Exit 0 when valid, 2 with the reason when not. The weights check builds
    the model on the meta device (names and shapes, no weights loaded).
    """
    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.config.pairing import check_weight_pairing

    resolved = resolve(load_config(file, overrides or []))
    unchecked = dict(resolved.unchecked)
    why = check_weight_pairing(resolved)
    if why is not None:
        unchecked["weights pairing"] = why
    for section, why in unchecked.items():
        err.print(f"note: {section} not checked: {why}")
    out.print(f"{file}: valid")


def _run_dir(cfg: Any, run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else Path(cfg.logging.run_dir.format(name=cfg.name))


def _run(file: Path | None, overrides: list[str] | None, run_dir: Path | None, progress: bool, virtual: bool,
         resume: Path | None = None) -> None:
    import json
    import logging

    from asyncflow_core.config import load_config, resolve
    from asyncflow_core.flow.launcher import launch

    if resume is not None:
        if run_dir is not None and run_dir != resume:
            raise ConfigError("--resume continues the run in its own directory; drop --run-dir")
        saved = resume / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; give the directory of an earlier run")
        if file is not None:
            # `asyncflow run --resume RUN_DIR key=value`: the first override lands in FILE's place
            if "=" not in str(file):
                raise ConfigError("with --resume the run's own config.yaml is used; give only dotted overrides")
            overrides = [str(file), *(overrides or [])]
        file, run_dir = saved, resume
    elif file is None:
        raise ConfigError("give a run config (YAML), or --resume RUN_DIR to continue a run")
    cfg = load_config(file, overrides or [])
    if resume is not None:
        from asyncflow_core.config.redact import redacted_paths

        left = redacted_paths(cfg.model_dump(mode="json", by_alias=True))
        if left:
            raise ConfigError(
                f"--resume {resume}: its config.yaml holds redacted secrets at {', '.join(left)}; give each again "
                f"as an override ({left[0]}=...) or have the plugin read it from an environment variable")
    logging.basicConfig(level=cfg.logging.level, format="%(levelname)s %(name)s: %(message)s")
    resolved = resolve(cfg)
    target = _run_dir(cfg, run_dir)
    try:
        summary = launch(resolved, virtual=virtual, run_dir=target, progress=progress and sys.stderr.isatty(),
                         resume=resume is not None)
    except KeyboardInterrupt:
        err.print(f"interrupted; what was collected is in {target}")
        raise typer.Exit(130) from None
    out.print_json(json.dumps({k: v for k, v in summary.items() if k not in ("utilisation", "step_end_s")}))
    made = [name for name in ("metrics.jsonl", "trace.json", "timeline.png", "reward.png", "checkpoints",
                              "final_model") if (target / name).exists()]
    err.print(f"run directory {target}: {', '.join(made)}")


@app.command("run")
def run_cmd(
    file: Annotated[Path | None, typer.Argument(help="YAML run config (omit with --resume).")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.total_steps=100.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Where metrics and traces go (default: logging.run_dir).")] = None,
    progress: Annotated[bool, typer.Option(help="Live progress display on a terminal.")] = True,
    resume: Annotated[Path | None, typer.Option(
        help="Continue the run in this directory from its newest checkpoint (its config.yaml, plus overrides).")] = None,
) -> None:
    """Run RL training as the config describes, with the launcher it names (local: one process; ray: Ray actors)."""
    _run(file, overrides, run_dir, progress, virtual=False, resume=resume)


@app.command("sim")
def sim_cmd(
    file: Annotated[Path, typer.Argument(help="YAML run config using simulated engines (rollout/trainer/transport: sim).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.total_steps=100.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Where metrics and traces go (default: logging.run_dir).")] = None,
    progress: Annotated[bool, typer.Option(help="Live progress display on a terminal.")] = True,
    payload: Annotated[str | None, typer.Option(help="What the sim engines return: lengths (default) or tokens.")] = None,
    calibrate: Annotated[list[Path] | None, typer.Option(
        help="A real run's directory (repeatable: runs at two batch sizes fit more): fit the sim latency model "
             "from their traces, then simulate FILE with it.")] = None,
) -> None:
    """Run a config on the virtual clock: the real runtime and store, time jumping to the next event."""
    from asyncflow_core.cli.calibrate import sim_overrides

    _run(file, sim_overrides(file, overrides or [], payload=payload, calibrate=calibrate or None), run_dir, progress,
         virtual=True)


from asyncflow_core.cli.plan import plan_cmd  # registered here, implemented there

app.command("plan")(plan_cmd)

from asyncflow_core.cli.eval import eval_cmd  # noqa: E402 - registered here, implemented there

app.command("eval")(eval_cmd)


@app.command("trace")
def trace_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A finished run's directory (holds spans.jsonl).")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="PNG path (default RUN_DIR/timeline.png).")] = None,
) -> None:
    """Render a run's timeline as a Gantt PNG (one lane per engine instance and stage)."""
    from asyncflow_core.flow.telemetry import gantt_png, load_spans

    path = gantt_png(load_spans(run_dir), output or run_dir / "timeline.png", title=str(run_dir))
    out.print(f"wrote {path}")


@app.command(
    "spec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def spec_cmd(
    ctx: typer.Context,
    plugin: Annotated[str, typer.Argument(help="Registered name of the backend to test.")],
    kind: Annotated[str | None, typer.Option(
        help="Kind, when the name is registered for several kinds the suite tests (a dataset of the same name "
             "is set aside: NAME means its other kind).")] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="Backend option key=value (YAML value); repeatable.")
    ] = None,
    report: Annotated[
        Path | None, typer.Option("--report", help="Write a markdown feature table: declared flags, test results.")
    ] = None,
    report_json: Annotated[
        Path | None, typer.Option("--json", help="Write the same report as JSON, for scripts.")
    ] = None,
) -> None:
    """Run the conformance suite against an installed plugin. Extra arguments go to pytest.

    The exit code is pytest's. With --report / --json the results are also
    written as a feature table (see docs/spec.md).
    """
    targets = {flag: _writable(path, flag) for flag, path in (("--report", report), ("--json", report_json)) if path}
    pm = get_plugin_manager()
    try:
        import asyncflow_spec  # noqa: F401
    except ImportError:
        raise AsyncflowError("the conformance suite is not installed: pip install asyncflow-spec") from None
    from asyncflow_spec import SPEC_CLASSES

    if kind:
        try:
            kind_ = PluginKind(kind)
        except ValueError:
            raise ConfigError(
                f"--kind {kind!r} is not a plugin kind; kinds: {', '.join(k.value for k in SPEC_CLASSES)}"
            ) from None
    else:
        kind_ = _spec_kind(plugin, [k for k in PluginKind if plugin in pm.registrations(k)], SPEC_CLASSES, pm)
    pm.lookup(kind_, plugin)
    spec_class = SPEC_CLASSES.get(kind_)
    if spec_class is None:
        raise AsyncflowError(f"the conformance suite has no tests for {kind_.value} backends yet")
    from asyncflow_core.config import apply_overrides

    options: dict[str, Any] = apply_overrides({}, option or [])
    pm.validate_options(kind_, plugin, options, where="--option")
    with tempfile.TemporaryDirectory(prefix="asyncflow-spec-") as tmp:
        module = Path(tmp) / f"test_spec_{kind_.value}.py"
        module.write_text(
            textwrap.dedent(
                f"""\
                from asyncflow_spec import {spec_class.__name__}


                class TestConformance({spec_class.__name__}):
                    backend = {plugin!r}
                    options = {options!r}
                """
            )
        )
        reporting: list[str] = []
        if targets:
            # stale files from an earlier run must not pass for this run's report
            for path in targets.values():
                path.unlink(missing_ok=True)
            reporting = ["-p", "asyncflow_spec.report"]
            if "--report" in targets:
                reporting += ["--spec-report", str(targets["--report"])]
            if "--json" in targets:
                reporting += ["--spec-report-json", str(targets["--json"])]
        cmd = [sys.executable, "-m", "pytest", str(module), "-p", "no:cacheprovider", "-q", *reporting, *ctx.args]
        env = dict(os.environ)
        result = subprocess.run(cmd, cwd=tmp, env=env, check=False)
    for flag, path in targets.items():
        if path.is_file():
            err.print(f"{flag}: wrote {path}")
        else:
            err.print(f"{flag}: no report written (pytest exited {result.returncode} before the session ended)")
    raise typer.Exit(result.returncode)


def _spec_kind(plugin: str, kinds: list[PluginKind], spec_classes: Any, pm: Any) -> PluginKind:
    """The kind ``asyncflow spec NAME`` tests when no ``--kind`` is given (a note on stderr when it chose).

    Only kinds the suite has tests for count. When the name is still
    registered for several, a ``dataset`` among them is set aside: a dataset
    named like an environment, reward or engine is the generator of that
    plugin's rows (``calculator``, ``guess``, ``arithmetic``), and the user
    asking to prove ``calculator`` means the environment. Anything else still
    ambiguous is one line naming the kinds and the ``--kind`` to pick one.
    """
    if not kinds:
        known = sorted({r.name for r in pm.all_registrations()})
        raise UnknownPluginError(f"no plugin named {plugin!r}; installed: {', '.join(known) or 'none'}")
    testable = [k for k in kinds if k in spec_classes]
    if not testable:
        raise AsyncflowError(
            f"the conformance suite has no tests for {' or '.join(k.value for k in kinds)} backends yet"
        )
    chosen = testable
    if len(chosen) > 1 and PluginKind.DATASET in chosen:
        chosen = [k for k in chosen if k is not PluginKind.DATASET]
    if len(chosen) > 1:
        raise AsyncflowError(
            f"{plugin!r} is registered as {', '.join(k.value for k in testable)}; pick one with --kind, "
            f"e.g. asyncflow spec {plugin} --kind {chosen[0].value}"
        )
    others = [k for k in testable if k is not chosen[0]]
    if others:
        err.print(
            f"testing the {chosen[0].value} {plugin!r}; for the {others[0].value} of that name: "
            f"asyncflow spec {plugin} --kind {others[0].value}",
            markup=False, highlight=False,
        )
    return chosen[0]


def _writable(path: Path, flag: str) -> Path:
    """``path`` made absolute (pytest runs elsewhere); a one-line error unless a file can be written there."""
    path = path.expanduser().resolve()
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'report.md'}")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist; create it or pick another path")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable; pick a path you can write to")
    return path


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: usage errors are click's; AsyncflowError becomes one line and an exit code."""
    try:
        app(args=argv)  # standalone: click prints its own usage errors and exits
    except AsyncflowError as exc:
        from asyncflow_core.config.redact import default_redactor

        print(f"error: {default_redactor().text(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
