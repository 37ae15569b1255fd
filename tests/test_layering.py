"""The one-way dependency: core imports no plugin or adapter; the spec imports only core (and test libraries).

Within those layers: no adapter imports another adapter (what they share is in
the core), and the core's modules import each other without a circle.
"""

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


ADAPTER_PACKAGES = sorted(REPO.glob("adapters/*/asyncflow_*"))


def imports_of(path: Path, *, lazy: bool) -> list[tuple[int, int, str, list[str]]]:
    """``(line, level, module, names)`` of every import in ``path``.

    With ``lazy=False`` only what runs when the module is imported: imports
    inside functions and under ``if TYPE_CHECKING:`` are left out.
    """
    tree = ast.parse(path.read_text(), str(path))
    if lazy:
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    else:
        nodes, stack = [], list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Import | ast.ImportFrom):
                nodes.append(node)
            elif isinstance(node, ast.If):
                test = node.test
                if not ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")):
                    stack += node.body
                stack += node.orelse
            elif isinstance(node, ast.Try):
                stack += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
            elif isinstance(node, ast.With | ast.ClassDef):
                stack += node.body
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, 0, a.name, []) for a in node.names]
        else:
            out.append((node.lineno, node.level, node.module or "", [a.name for a in node.names]))
    return out


def core_import_graph(*, lazy: bool) -> dict[str, set[str]]:
    """Module of ``asyncflow_core`` -> the modules of ``asyncflow_core`` it imports (``from pkg import mod`` counts
    as importing ``pkg.mod``)."""
    paths = {}
    for path in (REPO / "asyncflow_core").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for _, level, module, names in imports_of(path, lazy=lazy):
            base = ".".join(package[: len(package) - level + 1] + ([module] if module else [])) if level else module
            targets = [f"{base}.{n}" if f"{base}.{n}" in paths else base for n in names] or [base]
            deps |= {t for t in targets if t in paths and t != name}
        graph[name] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other round a circle (strongly connected, more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_finds_a_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_submodules_and_leaves_deferred_imports_to_lazy():
    eager, lazy = core_import_graph(lazy=False), core_import_graph(lazy=True)
    assert "asyncflow_core.columns" in eager["asyncflow_core.launchers.rank_driver"]  # from asyncflow_core import columns
    remote, weights = "asyncflow_core.launchers.ray.remote", "asyncflow_core.launchers.ray.weights"
    assert weights not in eager[remote] and weights in lazy[remote]  # under TYPE_CHECKING
    plugin, store = "asyncflow_core.store.deployments.plugin", "asyncflow_core.store.deployments.ray_store"
    assert store not in eager[plugin] and store in lazy[plugin]  # inside the factory


def test_core_modules_import_each_other_without_a_circle():
    # what runs at import time: a circle here is an import that fails or finds a half-initialised module
    assert import_circles(core_import_graph(lazy=False)) == []


def test_core_has_no_circle_even_through_deferred_imports():
    # imports inside functions and under TYPE_CHECKING too: a module that defers an import of its own importer
    # (a store reading its features back from the plugin that registers it) is a circle in the design
    assert import_circles(core_import_graph(lazy=True)) == []


def test_there_are_adapter_packages_to_check():
    names = {p.name for p in ADAPTER_PACKAGES}
    assert {"asyncflow_fsdp", "asyncflow_megatron", "asyncflow_vllm", "asyncflow_sglang"} <= names, names


@pytest.mark.parametrize("package", ADAPTER_PACKAGES, ids=lambda p: p.name)
def test_no_adapter_imports_another_adapter(package):
    # what engines share (the rank protocol, the step plan, rank devices) lives in asyncflow_core
    others = {p.name for p in ADAPTER_PACKAGES} - {package.name}
    found = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in sorted(package.rglob("*.py"))
             for line, level, module, names in imports_of(path, lazy=True)
             if level == 0 and module.split(".")[0] in others]
    assert not found, found


@pytest.mark.parametrize("model", [m for m in vars(models).values() if isinstance(m, type) and issubclass(m, models.StrictModel) and m is not models.StrictModel])
def test_every_config_field_is_described_and_documented(model):
    docs = (REPO / "docs" / "config.md").read_text()
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
        assert f"`{field.alias or name}`" in docs, f"docs/config.md lacks {model.__name__}.{name}"


def test_each_store_deployment_declares_its_features_once():
    """The registered record and the store answer with the same object (one definition, in deployments/features)."""
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.store import inprocess
    from asyncflow_core.store.deployments import features

    records = {name: reg.record for name, reg in get_plugin_manager().registrations("store").items()}
    assert records["inprocess"].features is inprocess.FEATURES is features.INPROCESS_FEATURES
    assert records["multiprocess"].features is features.MULTIPROCESS_FEATURES
    assert records["distributed"].features is features.DISTRIBUTED_FEATURES
    assert records["ray"].features is features.RAY_FEATURES


def test_no_flow_module_is_over_400_lines():
    """The flow layer stays in parts with one job each (issue: the flow layer as declared data); a module that
    grows past 400 lines is split, not stretched."""
    flow = Path(__file__).resolve().parents[1] / "asyncflow_core" / "flow"
    long = {p.name: n for p in flow.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these flow modules (lines): {long}"
