"""Episodes: what the rollout stage runs per prompt row, one generation request (a turn) at a time.

An episode turns one leased row into one written row. The rollout stage
owns the dispatch (replica slots, abort and resume with a prefix, re-queue
on a replica's death, the staleness bound); an episode says what its next
request is and what a finished turn means. Three kinds, a module each:

- :class:`SingleTurn` (flow/single_turn.py): one request, the row's prompt;
  its result is the row. Also the base of the others (the dispatch fields).
- :class:`MultiTurn` (flow/multi_turn.py): a conversation with an
  environment plugin, ``reset`` then a turn and a ``step`` at a time.
- :class:`~asyncflow_core.flow.captured.Captured` (flow/captured.py): a
  black-box agent on the capture endpoint; each of its calls is a turn.

:func:`build_episodes` (flow/episode_builder.py) picks the kind from the
run's config. Every name stays importable from here.

Staleness across turns: an episode is as old as its oldest sampled token.
Every request of a turn starts no newer than the episode's oldest token
(``held_versions``), so the stage's in-flight abort and its check of each
result cover the whole episode; an episode whose earlier turns fall out of
the bound starts again from the beginning (or is dropped under
``stale_policy: drop``).
"""

from __future__ import annotations

from asyncflow_core.flow.captured import AgentEpisodes, AgentSettings, Captured
from asyncflow_core.flow.episode_builder import EpisodeFactory, build_agent_episodes, build_episodes
from asyncflow_core.flow.multi_turn import EnvOpener, EpisodeSettings, MultiTurn, MultiTurnEpisodes, Progress
from asyncflow_core.flow.single_turn import SingleTurn, SingleTurnEpisodes, as_tuple

__all__ = ["AgentEpisodes", "AgentSettings", "Captured", "EnvOpener", "EpisodeFactory", "EpisodeSettings",
           "MultiTurn", "MultiTurnEpisodes", "Progress", "SingleTurn", "SingleTurnEpisodes", "as_tuple",
           "build_agent_episodes", "build_episodes"]
