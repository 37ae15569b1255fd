"""Plugin discovery: real distributions installed by pip with entry points, conflicts, block and disable."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncflow_core.errors import PluginConflictError, PluginError, UnknownPluginError
from asyncflow_core.plugins import (
    BUILTIN_PLUGINS,
    AsyncflowPluginManager,
    PluginKind,
    RewardBackend,
    get_plugin_manager,
    hookimpl,
)

PLUGIN_SOURCE = '''
from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import RewardBackend, hookimpl


class Brevity(Reward):
    def __init__(self, config):
        pass

    def score(self, sample):
        return float(len(sample.completion) <= 10)


@hookimpl
def asyncflow_rewards():
    yield RewardBackend(name="brevity", factory=Brevity, description="{description}")
'''


def make_distribution(root: Path, dist: str, module: str, entry: str, description: str) -> Path:
    src = root / dist
    (src / module).mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=64"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "1.2.3"

            [project.entry-points.asyncflow]
            {entry} = "{module}"
            """
        )
    )
    (src / module / "__init__.py").write_text(PLUGIN_SOURCE.replace("{description}", description))
    return src


def pip_install(src: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Two distributions, each with its own site dir, installed by pip: one good, one clashing."""
    root = tmp_path_factory.mktemp("plugins")
    good_site, clash_site = root / "site-good", root / "site-clash"
    pip_install(make_distribution(root, "asyncflow-brevity", "asyncflow_brevity", "brevity", "short answers"), good_site)
    pip_install(make_distribution(root, "asyncflow-terse", "asyncflow_terse", "terse", "also short"), clash_site)
    return good_site, clash_site


def test_installed_plugin_is_discovered(installed, monkeypatch, fresh_plugins):
    good_site, _ = installed
    monkeypatch.syspath_prepend(str(good_site))
    pm = get_plugin_manager()
    found = pm.lookup(PluginKind.REWARD, "brevity")
    assert (found.distribution, found.version, found.plugin) == ("asyncflow-brevity", "1.2.3", "brevity")
    reward = pm.create("reward", "brevity")
    from asyncflow_core.types import RewardInput

    assert reward.score(RewardInput(prompt="", completion="ok")) == 1.0


def test_clashing_names_name_both_distributions(installed, monkeypatch, fresh_plugins):
    for site in installed:
        monkeypatch.syspath_prepend(str(site))
    with pytest.raises(PluginConflictError) as info:
        get_plugin_manager()
    message = str(info.value)
    assert "asyncflow-brevity" in message and "asyncflow-terse" in message and "'brevity'" in message


def test_block_list_skips_a_plugin_by_entry_point_or_distribution(installed, monkeypatch, fresh_plugins):
    for site in installed:
        monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ASYNCFLOW_BLOCKED_PLUGINS", "terse")
    assert get_plugin_manager().lookup("reward", "brevity").distribution == "asyncflow-brevity"
    get_plugin_manager.cache_clear()
    monkeypatch.setenv("ASYNCFLOW_BLOCKED_PLUGINS", "asyncflow-brevity")
    assert get_plugin_manager().lookup("reward", "brevity").distribution == "asyncflow-terse"


def test_disable_autoload_keeps_builtins_only(installed, monkeypatch, fresh_plugins):
    for site in installed:
        monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ASYNCFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = get_plugin_manager()
    assert "brevity" not in pm.registrations("reward")
    assert "exact_match" in pm.registrations("reward")
    # and one named plugin can still be asked for explicitly
    get_plugin_manager.cache_clear()
    monkeypatch.setenv("ASYNCFLOW_PLUGINS", "terse")
    assert get_plugin_manager().lookup("reward", "brevity").distribution == "asyncflow-terse"


def test_cli_lists_an_installed_plugin(installed):
    good_site, _ = installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(good_site), os.environ.get("PYTHONPATH", "")])}
    env.pop("ASYNCFLOW_BLOCKED_PLUGINS", None)
    env.pop("ASYNCFLOW_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run(
        [sys.executable, "-m", "asyncflow_core", "plugins", "--kind", "reward"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "brevity" in out.stdout and "asyncflow-brevity 1.2.3" in out.stdout


def test_unknown_name_lists_what_exists(fresh_plugins):
    with pytest.raises(UnknownPluginError, match=r"available: .*exact_match"):
        get_plugin_manager().lookup("reward", "no-such-reward")


def test_builtins_come_from_one_literal_tuple_and_all_load(fresh_plugins):
    pm = get_plugin_manager()
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert set(BUILTIN_PLUGINS) <= names
    for registered in pm.all_registrations():
        if registered.plugin in BUILTIN_PLUGINS:
            assert registered.distribution == "asyncflow"


def test_hook_returning_the_wrong_record_type_is_reported():
    class Wrong:
        @hookimpl
        def asyncflow_samplers(self):
            return [RewardBackend(name="oops", factory=lambda c: None)]

    pm = AsyncflowPluginManager()
    pm.register(Wrong(), name="wrong")
    with pytest.raises(PluginError, match="must return SamplerBackend"):
        pm.collect()


def test_invalid_registration_names_are_rejected():
    with pytest.raises(PluginError, match="invalid reward name"):
        RewardBackend(name="Bad Name", factory=lambda c: None)


def test_every_hook_is_documented_in_docs_plugins_md():
    text = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    for kind in PluginKind:
        assert f"`{kind.hook_name}`" in text, f"docs/plugins.md does not document hook {kind.hook_name}"
    for record in ("RolloutEngineBackend", "TrainEngineBackend", "StoreBackend", "SamplerBackend",
                   "WeightTransportBackend", "AlgorithmBackend", "RewardBackend", "DatasetBackend", "LauncherBackend"):
        assert record in text, f"docs/plugins.md does not mention {record}"


def test_hook_docstrings_carry_a_complete_example():
    from asyncflow_core.plugins import AsyncflowHookSpecs

    for kind in PluginKind:
        doc = getattr(AsyncflowHookSpecs, kind.hook_name).__doc__
        assert "Example::" in doc and "@hookimpl" in doc, kind.hook_name


def test_hook_docstring_examples_run_and_register():
    """Each hook's example is executed and registered: the reference docs cannot rot."""
    import types

    from asyncflow_core.plugins import AsyncflowHookSpecs

    for kind in PluginKind:
        doc = getattr(AsyncflowHookSpecs, kind.hook_name).__doc__
        example = textwrap.dedent(doc.split("Example::", 1)[1])
        module = types.ModuleType(f"example_{kind.value}")
        exec(compile(example, f"<{kind.hook_name} example>", "exec"), module.__dict__)
        pm = AsyncflowPluginManager()
        pm.register(module, name=module.__name__)
        pm.check_pending()
        records = pm.registrations(kind)
        assert len(records) == 1, f"{kind.hook_name} example registered {list(records)}"
