"""Generate docs/engines.md: what every engine backend in the repository declares, and what the spec suite found.

    .venv/bin/python scripts/engines_matrix.py                  # all backends -> docs/engines.md
    .venv/bin/python scripts/engines_matrix.py --keep /tmp/matrix          # also keep each outcome
    .venv/bin/python scripts/engines_matrix.py --keep /tmp/matrix --only vllm   # rerun one, reuse the rest
    .venv/bin/python scripts/engines_matrix.py --keep /tmp/matrix --render      # rewrite the file only

Each backend runs the conformance suite in its own interpreter, one of two ways:

- by plugin name: ``asyncflow spec NAME --kind KIND -o key=value ... --json FILE``,
  with the same tiny-model options its own tests use (a literal dict, or what
  a function returns in the backend's interpreter, e.g. the fsdp adapter's
  ``tiny_options(world_size=2)``);
- through its own test modules: ``pytest PATH -p asyncflow_spec.report --spec-only``,
  for backends whose spec classes need fixtures that ship with their tests
  (a model config, a server to talk to).

A backend that is not installed in its interpreter, or that needs a GPU this
machine lacks, is listed as such: never as a failure, never silently left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from asyncflow_spec.report import BackendReport, SpecReport, render_backend, summary_line


@dataclass(frozen=True)
class Backend:
    """One engine backend and how to run the spec suite against it."""

    kind: str  #: rollout_engine or train_engine
    name: str  #: the registered name
    #: a dict, or (module, function, kwargs): the function's result in the backend's interpreter
    options: dict[str, Any] | tuple[str, str, dict[str, Any]] | None = None
    tests: str | None = None  #: pytest path / node id of the backend's own spec classes (instead of `asyncflow spec`)
    python: str = ".venv/bin/python"  #: interpreter, relative to the repository (or absolute)
    needs: tuple[str, ...] = ()  #: modules that must import in that interpreter
    gpu: bool = False  #: the suite needs CUDA
    timeout_s: int = 900
    where: str = ""  #: the module that implements it (shown in the matrix)
    note: str = ""  #: what a reader must know about this run (shown under the matrix)


@dataclass
class Outcome:
    """What running one backend produced: reports, or the honest reason why there are none."""

    backend: Backend
    status: str  #: ran, not installed here, not run: needs a GPU, failed to run
    detail: str = ""
    reports: list[BackendReport] = field(default_factory=list)
    exit_status: int | None = None
    seconds: float = 0.0


#: Every engine backend in the repository. Rollout engines run through their own spec classes, which carry
#: the tiny model options and the ``weights()`` an update test needs; the rest by name, with their tests' options.
BACKENDS: tuple[Backend, ...] = (
    Backend("rollout_engine", "torch", tests="tests/test_torch_rollout.py::TestTorchRolloutSpec",
            where="asyncflow_plugins/hf/rollout.py"),
    Backend("rollout_engine", "toy", tests="tests/test_spec_builtins.py::TestToyRollout",
            where="asyncflow_plugins/toy/rollout.py"),
    Backend("rollout_engine", "sim", tests="tests/test_sim_engines.py::TestSimRollout",
            where="asyncflow_plugins/sim/rollout.py"),
    Backend("rollout_engine", "vllm", tests="adapters/vllm/tests", python=".venv-vllm/bin/python",
            needs=("asyncflow_vllm", "vllm"), where="adapters/vllm",
            note="a real vLLM on its CPU backend, in its own environment `.venv-vllm`"),
    Backend("rollout_engine", "sglang", tests="adapters/sglang/tests/test_sglang_engine.py",
            needs=("asyncflow_sglang",), where="adapters/sglang",
            note="run against `asyncflow_sglang.testing`, the adapter's protocol fake of an SGLang server "
                 "(a toy model behind SGLang's routes), not a real SGLang, which needs a GPU"),
    Backend("train_engine", "toy", options={"vocab_size": 16}, where="asyncflow_plugins/toy/train.py"),
    Backend("train_engine", "sim", options={"time_scale": 1e-3}, where="asyncflow_plugins/sim/train.py"),
    Backend("train_engine", "fsdp", options=("asyncflow_fsdp.testing", "tiny_options", {"world_size": 2}),
            needs=("asyncflow_fsdp",), where="adapters/fsdp"),
    Backend("train_engine", "megatron", tests="adapters/megatron/tests/test_megatron_engine.py::TestMegatronSpecCPU",
            needs=("asyncflow_megatron", "megatron.core"), where="adapters/megatron", timeout_s=1800,
            note="the adapter's CPU test path (gloo, world 1); its CUDA spec classes (TP, PP, the distributed "
                 "optimizer) need a GPU and are not in this table"),
)

KIND_TITLES = {"rollout_engine": "Rollout engines", "train_engine": "Train engines"}

#: What each backend does on a GPU that no run has exercised yet: written from the upstream source at the pinned
#: version, with ``gpu``-marked tests (``make test-gpu``) that check it on the first CUDA host. A line moves out of
#: here when such a run passes.
GPU_PATHS: tuple[tuple[str, str], ...] = (
    ("vllm", "vLLM 0.32.0 on CUDA: the weight group sends from a GPU none of vLLM's workers uses (NCCL refuses "
             "two ranks of one group on one GPU), else through the CPU over gloo; sleep/wake with "
             "`enable_sleep_mode` (in-flight requests held, a level-2 sleep needs a full update before generating); "
             "NCCL waits end at the update's deadline; read-back of vocab-padded tensors under tensor parallelism"),
    ("sglang", "SGLang 0.5.20-0.5.23 only, read from their source; tested against the adapter's protocol fake "
               "(`asyncflow_sglang.testing`), never against a real server"),
    ("fsdp", "CUDA at world 2: the sharded model is built on the meta device with weights broadcast from rank 0, "
             "so only rank 0 holds the whole model in CPU memory; NCCL ranks pinned to their devices (world 1 with "
             "bf16 mixed precision ran)"),
    ("megatron", "CUDA: the bf16 fresh-engine load with the distributed optimizer (fixed after the first run, not "
                 "rerun); TP/PP/DP layouts over NCCL; Transformer Engine; the fused softmax only where its "
                 "extension imports"),
    ("dist transport / distributed store", "NCCL: each rank's device chosen from `device`, `LOCAL_RANK` or the "
                                           "constructing thread and set in every helper thread; one NCCL lane per "
                                           "client; a transfer past its deadline aborts its communicator"),
)


def _python(backend: Backend) -> Path:
    path = Path(backend.python)
    return path if path.is_absolute() else REPO / path


def _ask(python: Path, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def probe(backend: Backend) -> Outcome | None:
    """An Outcome saying why ``backend`` cannot run here, or None when it can."""
    python = _python(backend)
    if not python.exists():
        return Outcome(backend, "not installed here", f"no interpreter `{backend.python}`")
    for module in backend.needs:
        proc = _ask(python, f"import {module}")
        if proc.returncode != 0:
            return Outcome(backend, "not installed here", f"`import {module}` fails with `{backend.python}` "
                                                           f"({_last_line(proc.stderr).split(':', 1)[0]})")
    if backend.gpu:
        proc = _ask(python, "import torch; print(torch.cuda.is_available())")
        if proc.stdout.strip() != "True":
            return Outcome(backend, "not run: needs a GPU", "its suite needs CUDA; none is visible here")
    return None


def _options(backend: Backend, python: Path) -> dict[str, Any]:
    if backend.options is None or isinstance(backend.options, dict):
        return dict(backend.options or {})
    module, function, kwargs = backend.options
    code = (f"import importlib, json; m = importlib.import_module({module!r}); "
            f"print(json.dumps(getattr(m, {function!r})(**json.loads({json.dumps(kwargs)!r}))))")
    proc = _ask(python, code)
    if proc.returncode != 0:
        raise RuntimeError(f"options {module}.{function}(**{kwargs}) failed: {_last_line(proc.stderr)}")
    return json.loads(proc.stdout)


def run_backend(backend: Backend) -> Outcome:
    """Run the suite against ``backend`` (after :func:`probe`) and collect its report."""
    cannot = probe(backend)
    if cannot is not None:
        return cannot
    python = _python(backend)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asyncflow-matrix-") as tmp:
        out = Path(tmp) / "report.json"
        if backend.tests is None:
            try:
                options = _options(backend, python)
            except RuntimeError as exc:
                return Outcome(backend, "failed to run", str(exc))
            cmd = [str(python), "-m", "asyncflow_core", "spec", backend.name, "--kind", backend.kind,
                   "--json", str(out)]
            for key, value in options.items():
                cmd += ["-o", f"{key}={json.dumps(value)}"]  # JSON is YAML: the CLI parses nested values
        else:
            cmd = [str(python), "-m", "pytest", backend.tests, "-q", "-p", "no:cacheprovider",
                   "-p", "asyncflow_spec.report", "--spec-only", "--spec-report-json", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=backend.timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(backend, "failed to run", f"did not finish in {backend.timeout_s} s",
                           seconds=time.perf_counter() - started)
        seconds = time.perf_counter() - started
        if not out.is_file():
            why = _last_line(proc.stderr) or _last_line(proc.stdout)
            return Outcome(backend, "failed to run", f"exit {proc.returncode}: {why}", seconds=seconds)
        report = SpecReport.model_validate_json(out.read_text())
    mine = [r for r in report.backends if r.kind == backend.kind and r.backend == backend.name]
    if not mine:
        return Outcome(backend, "failed to run", f"no spec class for {backend.kind} {backend.name!r} was collected "
                                                 f"(exit {proc.returncode})", seconds=seconds)
    return Outcome(backend, "ran", reports=mine, exit_status=report.exit_status, seconds=seconds)


# ----------------------------------------------------------------------------- markdown

_CELL = {
    "verified": "yes ✓",
    "declared": "yes",
    "error-verified": "no ✓",
    "off": "no",
    "failed": "**FAIL**",
}


def _flag_cell(report: BackendReport, flag: str, verdicts: dict[str, str]) -> str:
    if flag not in report.features:
        return ""
    value = report.features[flag]
    if verdicts[flag] == "value":
        return ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    return _CELL[verdicts[flag]]


def _label(report: BackendReport, several: bool) -> str:
    return f"`{report.backend}`" + (f" ({report.test_class.rsplit('::', 1)[-1]})" if several else "")


def render(outcomes: list[Outcome]) -> str:
    """docs/engines.md: the matrices first, then what could not run, then every backend's full report."""
    lines = [
        "# Engines: feature matrix",
        "",
        "<!-- generated by scripts/engines_matrix.py; do not edit by hand: rerun the script -->",
        "",
        "What each engine backend in this repository declares in its `Features` model, and what the",
        "conformance suite (`asyncflow spec NAME --report`, docs/spec.md) found when it ran against it",
        f"with tiny random-weight models. Generated {time.strftime('%Y-%m-%d', time.gmtime())} on "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}; "
        f"{_environment()}.",
        "",
        "Cells: **yes ✓** declared and verified by the suite · **yes** declared, but no spec test exercised "
        "it (none exists yet, or it was skipped: see Details) · **no ✓** not supported, and the method's "
        "documented `UnsupportedFeatureError` verified · **no** not supported, not exercised · **FAIL** a "
        "test of this feature failed. Transport cells list the "
        "weight transports the engine works with.",
        "",
    ]
    for kind, title in KIND_TITLES.items():
        ran = [o for o in outcomes if o.backend.kind == kind and o.status == "ran"]
        rest = [o for o in outcomes if o.backend.kind == kind and o.status != "ran"]
        lines += [f"## {title}", ""]
        flags: list[str] = []
        for o in ran:
            for r in o.reports:
                flags += [f for f in r.features if f not in flags]
        header = ["engine", "from", "spec tests", *[f.removeprefix("supports_") for f in flags]]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for o in ran:
            for r in o.reports:
                verdicts = r.verdicts()
                cells = [_label(r, len(o.reports) > 1), f"`{o.backend.where}`", summary_line(r),
                         *[_flag_cell(r, f, verdicts) for f in flags]]
                lines.append("| " + " | ".join(cells) + " |")
        for o in rest:
            cells = [f"`{o.backend.name}`", f"`{o.backend.where}`", f"{o.status}: {o.detail}"] + [""] * len(flags)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        notes = [o for o in ran + rest if o.backend.note]
        lines += [f"- `{o.backend.name}`: {o.backend.note}." for o in notes] + ([""] if notes else [])
    lines += ["## GPU paths: fixed by reading, never run", "",
              "These paths were written and fixed against the upstream source at the pinned versions and are "
              "checked by `gpu`-marked tests (`make test-gpu`) that no CUDA host has run yet; a line leaves this "
              "list when such a run passes. What the one CUDA run so far (one H100) passed and found is in "
              "docs/gpu-runs.md.", ""]
    lines += [f"- `{name}`: {text}." for name, text in GPU_PATHS] + [""]
    lines += ["## How each backend was run", "",
              "Wall-clock seconds of the whole run, interpreter start-up included (they vary with the machine's load).",
              "",
              "| engine | interpreter | how | wall s |", "|---|---|---|---|"]
    for o in outcomes:
        b = o.backend
        how = (f"`pytest {b.tests} -p asyncflow_spec.report --spec-only`" if b.tests
               else f"`asyncflow spec {b.name} --kind {b.kind}` with options "
                    + (f"`{json.dumps(b.options)}`" if isinstance(b.options, dict) or b.options is None
                       else f"`{b.options[0]}.{b.options[1]}(**{json.dumps(b.options[2])})`"))
        secs = f"{o.seconds:.0f}" if o.status == "ran" else o.status
        lines.append(f"| {b.kind} `{b.name}` | `{b.python}` | {how} | {secs} |")
    lines += ["", "## Details", ""]
    for o in outcomes:
        for r in o.reports:
            lines.append(render_backend(r, level=3))
    return "\n".join(lines).rstrip() + "\n"


def _environment() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    device = "CUDA " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return f"torch {torch.__version__}, {device}"


def save(outcome: Outcome, folder: Path) -> None:
    """Keep ``outcome`` in ``folder`` so a later ``--only`` run can reuse it."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"status": outcome.status, "detail": outcome.detail, "exit_status": outcome.exit_status,
               "seconds": outcome.seconds, "reports": [r.model_dump(mode="json") for r in outcome.reports]}
    (folder / f"{outcome.backend.kind}-{outcome.backend.name}.json").write_text(json.dumps(payload, indent=1))


def load(backend: Backend, folder: Path) -> Outcome | None:
    """The outcome :func:`save` kept for ``backend``, or None."""
    path = folder / f"{backend.kind}-{backend.name}.json"
    if not path.is_file():
        return None
    payload = json.loads(path.read_text())
    reports = [BackendReport.model_validate(r) for r in payload.pop("reports")]
    return Outcome(backend, reports=reports, **payload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "engines.md", help="Markdown file to write.")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="Run only backends of this name (repeatable); the others come from --keep, "
                             "or are left out of the file without it.")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="Save every backend's outcome in DIR, and reuse the saved ones that --only skips.")
    parser.add_argument("--render", action="store_true",
                        help="Run nothing: write the file from the outcomes saved in --keep.")
    args = parser.parse_args(argv)
    if args.render and not args.keep:
        parser.error("--render writes the outcomes saved in --keep DIR; give --keep")
    chosen = [] if args.render else [b for b in BACKENDS if not args.only or b.name in args.only]
    if args.only and not chosen:
        parser.error(f"--only {args.only}: no such backend; known: {sorted({b.name for b in BACKENDS})}")
    if not args.output.parent.is_dir():
        parser.error(f"--output {args.output}: directory {args.output.parent} does not exist")
    outcomes = []
    for backend in BACKENDS:
        if backend not in chosen:
            kept = load(backend, args.keep) if args.keep else None
            if kept is not None:
                outcomes.append(kept)
            continue
        print(f"{backend.kind} {backend.name}: ", end="", flush=True, file=sys.stderr)
        outcome = run_backend(backend)
        outcomes.append(outcome)
        if args.keep:
            save(outcome, args.keep)
        found = "; ".join(summary_line(r) for r in outcome.reports) or outcome.detail
        print(f"{outcome.status} ({found}) in {outcome.seconds:.0f} s", file=sys.stderr)
    args.output.write_text(render(outcomes))
    print(f"wrote {args.output}", file=sys.stderr)
    failed = [o for o in outcomes if o.status == "failed to run" or (o.exit_status not in (None, 0))]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
