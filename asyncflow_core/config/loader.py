"""Load a run config from YAML plus dotted command-line overrides, and resolve its plugins."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncflow_core.config.errors import format_validation_error
from asyncflow_core.config.models import COMPONENT_SECTIONS, Component, RunConfig
from asyncflow_core.errors import ConfigError, PluginError
from asyncflow_core.plugins import AsyncflowPluginManager, PluginKind, Registered, get_plugin_manager


#: one dotted part of an override path: a field name, then any number of list indices (``stages[0]``)
_PART = re.compile(r"([^\[\]]+)((?:\[\d+\])*)")

#: a path into the config: field names (str) and list indices (int)
OverridePath = list[str | int]


def parse_override(text: str) -> tuple[OverridePath, Any]:
    """``"trainer.options.lr=0.001"`` -> ``(["trainer", "options", "lr"], 0.001)``; the value is parsed as YAML.

    A part may index a list: ``"pipeline.stages[0].options.x=3"`` ->
    ``(["pipeline", "stages", 0, "options", "x"], 3)``.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like section.field=value (e.g. trainer.total_steps=100)")
    parts: OverridePath = []
    for part in key.split("."):
        if not part:
            raise ConfigError(f"override {text!r} has an empty path component in {key!r}")
        match = _PART.fullmatch(part)
        if match is None:
            raise ConfigError(f"override {text!r}: {part!r} is not a field name or name[index] "
                              "(e.g. pipeline.stages[0].options.x=3)")
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc.problem})") from None
    return parts, value


def _dotted(parts: OverridePath) -> str:
    """``["pipeline", "stages", 0, "options"]`` -> ``"pipeline.stages[0].options"``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _step(node: Any, part: str | int, parts: OverridePath, depth: int, text: str) -> Any:
    """The child of ``node`` at ``part`` (creating a missing mapping); one-line errors for a wrong shape."""
    here = _dotted(parts[: depth + 1])
    if isinstance(part, int):
        where = _dotted(parts[:depth])
        if node is None:
            raise ConfigError(f"override {text!r}: {where} is not set, so it has no [{part}]; "
                              f"set the whole list ({where}=[...])")
        if not isinstance(node, list):
            raise ConfigError(f"override {text!r}: {where} is {node!r}, not a list; index only a list")
        if part >= len(node):
            have = f"indices 0..{len(node) - 1}" if node else "no entries"
            raise ConfigError(f"override {text!r}: {here} is out of range ({_dotted(parts[:depth])} has {have}); "
                              "set the whole list to add entries")
        return node[part]
    if not isinstance(node, dict):
        where = _dotted(parts[:depth])
        if isinstance(node, list):
            raise ConfigError(f"override {text!r}: {where} is a list; index it (e.g. {where}[0].{part})")
        raise ConfigError(f"override {text!r}: {where} is {node!r}, not a section with fields")
    if node.get(part) is None and depth + 1 < len(parts) and not isinstance(parts[depth + 1], int):
        node[part] = {}
    return node.get(part)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each dotted override in (a copy of) ``data``; intermediate mappings are created as needed.

    List entries are reached by index (``pipeline.stages[0].options.x=3``); an
    index past the end is an error (set the whole list to add entries).
    """
    result = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = result
        for depth, part in enumerate(parts[:-1]):
            node = _step(node, part, parts, depth, text)
        last = parts[-1]
        _step(node, last, parts, len(parts) - 1, text)  # the same shape checks as on the way down
        node[last] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file into a mapping; every failure is a one-line :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config path {str(path)!r} is a directory; give a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, data: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a run config from a YAML file (or ``data``) with ``overrides`` applied.

    Raises :class:`ConfigError` whose message names each bad field, the bad
    value and what is allowed. Plugin options are checked by :func:`resolve`.
    """
    raw = read_yaml(path) if path is not None else dict(data or {})
    raw = apply_overrides(raw, overrides)
    source = f"{path}: " if path is not None else ""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source + format_validation_error(exc, model=RunConfig)) from None


@dataclass(frozen=True)
class ResolvedComponent:
    """A component section bound to its plugin: the registration and the validated options."""

    section: str
    registered: Registered
    options: BaseModel

    def create(self) -> Any:
        """Build the backend from its factory."""
        return self.registered.record.factory(self.options)


@dataclass(frozen=True)
class ResolvedConfig:
    """A run config whose every component was found and whose options were validated."""

    config: RunConfig
    components: dict[str, ResolvedComponent]
    unchecked: dict[str, str] = field(default_factory=dict)  #: section -> why it was not checked

    def with_factory(self, section: str, factory: Any) -> ResolvedConfig:
        """This config with ``section``'s backend built by ``factory`` (same options): a subclass that records
        or instruments the plugin's class, in tests and benchmarks. ``KeyError`` for a section it does not have."""
        import dataclasses

        comp = self.components[section]
        record = dataclasses.replace(comp.registered.record, factory=factory)
        registered = dataclasses.replace(comp.registered, record=record)
        return dataclasses.replace(self, components={**self.components,
                                                     section: dataclasses.replace(comp, registered=registered)})

    def dump(self) -> dict[str, Any]:
        """The full config with defaults filled in, plugin options included (for ``config show``)."""
        out = self.config.model_dump(mode="json", by_alias=True)
        for section, comp in self.components.items():
            if section.startswith("pipeline.stages["):
                target = out["pipeline"]["stages"][int(section[len("pipeline.stages["):-1])]
            elif section.startswith("pipeline.replace."):
                target = out["pipeline"]["replace"][section[len("pipeline.replace."):]]
            elif section.startswith("eval.datasets["):
                target = out["eval"]["datasets"][int(section[len("eval.datasets["):-1])]
            else:
                target = out[section]
            target["options"] = comp.options.model_dump(mode="json")
        return out


def resolve(config: RunConfig, pm: AsyncflowPluginManager | None = None) -> ResolvedConfig:
    """Look up each component's plugin and validate its options with the plugin's config model.

    All problems are collected into one :class:`ConfigError`. A section whose
    kind has no plugin installed at all is listed in ``unchecked`` instead
    (e.g. no launcher plugin installed in a minimal environment).
    """
    pm = pm or get_plugin_manager()
    components: dict[str, ResolvedComponent] = {}
    unchecked: dict[str, str] = {}
    problems: list[str] = []
    for section, kind_name in COMPONENT_SECTIONS.items():
        kind = PluginKind(kind_name)
        comp: Component = getattr(config, section)
        if not pm.registrations(kind):
            unchecked[section] = f"no {kind.value} plugin is installed"
            continue
        try:
            registered = pm.lookup(kind, comp.name)
            options = pm.validate_options(kind, comp.name, comp.options, where=f"{section}.options")
        except (ConfigError, PluginError) as exc:
            problems.append(f"{section}.name: {exc}" if isinstance(exc, PluginError) else str(exc))
            continue
        components[section] = ResolvedComponent(section, registered, options)
    stage_comps = [(f"pipeline.stages[{i}]", c) for i, c in enumerate(config.pipeline.stages)]
    stage_comps += [(f"pipeline.replace.{role}", c) for role, c in config.pipeline.replace.items()]
    for role in config.pipeline.replace:
        if role not in REPLACEABLE_STAGES:
            problems.append(f"pipeline.replace: {role!r} cannot be replaced; replaceable: {sorted(REPLACEABLE_STAGES)}")
    for where, comp in stage_comps:
        try:
            registered = pm.lookup(PluginKind.STAGE, comp.name)
            options = pm.validate_options(PluginKind.STAGE, comp.name, comp.options, where=f"{where}.options")
        except (ConfigError, PluginError) as exc:
            problems.append(f"{where}.name: {exc}" if isinstance(exc, PluginError) else str(exc))
            continue
        components[where] = ResolvedComponent(where, registered, options)
    eval_sets = [(f"eval.datasets[{i}]", c) for i, c in enumerate(config.eval.datasets)] if config.eval else []
    for where, comp in eval_sets if pm.registrations(PluginKind.DATASET) else []:
        try:
            registered = pm.lookup(PluginKind.DATASET, comp.name)
            options = pm.validate_options(PluginKind.DATASET, comp.name, comp.options, where=f"{where}.options")
        except (ConfigError, PluginError) as exc:
            problems.append(f"{where}.name: {exc}" if isinstance(exc, PluginError) else str(exc))
            continue
        components[where] = ResolvedComponent(where, registered, options)
    if config.environment is not None:  # optional section: absent means single-turn rollouts
        env = config.environment
        try:
            registered = pm.lookup(PluginKind.ENVIRONMENT, env.name)
            options = pm.validate_options(PluginKind.ENVIRONMENT, env.name, env.options, where="environment.options")
        except (ConfigError, PluginError) as exc:
            problems.append(f"environment.name: {exc}" if isinstance(exc, PluginError) else str(exc))
        else:
            components["environment"] = ResolvedComponent("environment", registered, options)
    if config.agent is not None:  # optional section: captured agent episodes
        if config.environment is not None:
            problems.append("agent and environment are both set; an episode is either an environment's or a "
                            "captured agent's: keep one of the two sections")
        try:
            import_agent(config.agent.entry)
        except ConfigError as exc:
            problems.append(str(exc))
    algorithm = components.get("algorithm")
    group_size = getattr(algorithm.options, "group_size", None) if algorithm is not None else None
    if isinstance(group_size, int) and group_size != config.rollout.n:
        # each prompt yields rollout.n samples: any other group size fails every group mid-run
        problems.append(f"algorithm.options.group_size={group_size} contradicts rollout.n={config.rollout.n} "
                        f"(samples per prompt); set group_size to {config.rollout.n} or leave it unset")
    special = config.model.special_token_problem()
    if special is not None:
        problems.append(special)
    if problems:
        raise ConfigError("; ".join(problems))
    return ResolvedConfig(config, components, unchecked)


def import_agent(entry: str) -> Any:
    """The ``agent.entry`` coroutine function (``package.module:function``), or a one-line :class:`ConfigError`."""
    import importlib
    import inspect

    module, _, name = entry.partition(":")
    if not module or not name or not re.fullmatch(r"[A-Za-z_][\w.]*", module) or not name.isidentifier():
        raise ConfigError(f"agent.entry={entry!r} is not `package.module:function`; name the agent coroutine so")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the module's own error on import
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"agent.entry={entry!r}: module {module!r} cannot be imported ({why}); install it or fix "
                          "the name") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ConfigError(f"agent.entry={entry!r}: module {module!r} has no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"agent.entry={entry!r} is not an async function; the agent must be "
                          "`async def agent(record, *, base_url, api_key, **options)`")
    return fn


#: built-in stages ``pipeline.replace`` may swap for a plugin
REPLACEABLE_STAGES = frozenset({"reward"})
