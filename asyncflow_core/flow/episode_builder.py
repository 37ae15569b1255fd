"""The run's episode factory, from its config: single-turn, multi-turn (``environment``) or captured (``agent``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from asyncflow_core.capture import CaptureServer
from asyncflow_core.flow.captured import AgentEpisodes, AgentSettings, plugin_scorer
from asyncflow_core.flow.multi_turn import EnvOpener, EpisodeSettings, MultiTurnEpisodes
from asyncflow_core.flow.render import Renderer
from asyncflow_core.flow.single_turn import SingleTurnEpisodes
from asyncflow_core.types import SamplingParams

__all__ = ["EpisodeFactory", "build_episodes"]

EpisodeFactory = SingleTurnEpisodes | MultiTurnEpisodes | AgentEpisodes


class _PoolOpener:
    """``open_env`` over an :class:`~asyncflow_core.flow.env_pool.EnvironmentPool`; ``aclose`` closes the pool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def __call__(self) -> Awaitable[Any]:
        return self.pool.open()

    async def aclose(self) -> None:
        await self.pool.close()


def build_episodes(resolved: Any, tokenizer: Any, plugin_manager: Any = None, *,
                   stop_ids: Sequence[int] = (), open_env: EnvOpener | None = None,
                   reward: Any = None) -> EpisodeFactory:
    """The run's episode factory: multi-turn with an ``environment`` section, captured with an ``agent``
    section (flow/captured.py: ``reward`` is the run's reward plugin, for episodes the agent leaves unscored;
    default: one made from the ``reward`` section), else single-turn.

    ``resolved`` is the run's :class:`~asyncflow_core.config.loader.ResolvedConfig` (its ``environment``
    component: the plugin and its validated options; the section's ``max_turns``, ``max_episode_tokens`` and
    ``step_timeout_s`` when it has them), ``tokenizer`` the run's, ``stop_ids`` the requests' stop tokens (a chat
    template's end-of-turn token is one of them). ``plugin_manager`` is accepted for plugins resolved late (unused
    when the section is resolved). ``open_env`` opens one episode's environment (the environment pool's; default:
    the plugin's factory in this process).
    """
    cfg = getattr(resolved, "config", None)
    if getattr(cfg, "agent", None) is not None:
        return build_agent_episodes(resolved, tokenizer, stop_ids=stop_ids, reward=reward)
    comp = getattr(resolved, "components", {}).get("environment")
    if comp is None:
        return SingleTurnEpisodes()
    section = getattr(cfg, "environment", None)
    record = comp.registered.record
    options = comp.options

    def open_plugin_env() -> Any:
        return record.factory(options)

    if open_env is None and section is not None and hasattr(section, "workers"):
        # the run's environments live in a pool: ``workers`` open at once, in worker processes when asked
        # (environment.processes, or a ``blocking`` environment), every failure one EnvironmentFailure line
        from asyncflow_core.flow.env_pool import EnvironmentPool

        if section.workers is None and cfg is not None:  # every decode slot may hold an episode
            section = section.model_copy(update={"workers": cfg.rollout.replicas * cfg.rollout.max_inflight})
        open_env = _PoolOpener(EnvironmentPool.from_config(section))

    features = record.declared_features
    owns_reward = bool(getattr(features, "owns_reward", False))
    step_timeout_s = getattr(section, "step_timeout_s", 60.0)
    if isinstance(open_env, _PoolOpener) and step_timeout_s is not None:
        # the pool times each call itself and restarts a worker stuck in one; with the same limit the episode's
        # own timer would win the race, and a stuck worker would stay until its close timed out too
        step_timeout_s = 2 * step_timeout_s
    settings = EpisodeSettings(
        open_env=open_env or open_plugin_env,
        renderer=Renderer(tokenizer, stop_ids),
        decode=tokenizer.decode,
        max_turns=int(getattr(section, "max_turns", 8)),
        max_episode_tokens=getattr(section, "max_episode_tokens", None),
        step_timeout_s=step_timeout_s,
        owns_reward=owns_reward,
        seed=int(getattr(cfg, "seed", 0) or 0),
    )
    return MultiTurnEpisodes(settings)


def build_agent_episodes(resolved: Any, tokenizer: Any, *, stop_ids: Sequence[int] = (),
                         reward: Any = None) -> AgentEpisodes:
    """Captured episodes for the ``agent`` section: its coroutine (imported once more: the loader checked it),
    a capture server over the run's tokenizer and sampling (a :class:`ConfigError` when the tokenizer has no
    chat template), and the reward plugin for episodes the agent does not score."""
    from asyncflow_core.config.loader import import_agent

    cfg = resolved.config
    section = cfg.agent
    ro = cfg.rollout
    sampling = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
                              top_k=ro.top_k, stop_token_ids=tuple(int(t) for t in stop_ids))
    server = CaptureServer(None, tokenizer, sampling=sampling)
    on_close = None
    if reward is None and "reward" in resolved.components:
        comp = resolved.components["reward"]
        reward = comp.registered.record.factory(comp.options)
        if asyncio.iscoroutinefunction(getattr(reward, "shutdown", None)):  # a remote reward pool it started
            on_close = reward.shutdown
    score = plugin_scorer(reward, tokenizer.decode, timeout_s=cfg.reward.timeout_s) if reward is not None else None
    settings = AgentSettings(agent=import_agent(section.entry), server=server, entry=section.entry,
                             options=dict(section.options), timeout_s=section.timeout_s,
                             max_calls=section.max_calls, score=score)
    return AgentEpisodes(settings, on_close=on_close)
