"""The environment contract: multi-turn, tool-using episodes (gym-style, async).

An episode is a conversation between the policy and an environment:

1. ``reset(record, seed=...)`` turns a dataset row into the first
   :class:`Observation` (the prompt);
2. the policy samples a turn; the runtime hands it to ``step`` as an
   :class:`Action` (the sampled token ids, and their text decoded once for
   the environment to read: the runtime never re-encodes it);
3. ``step`` returns a :class:`Step`: the next observation, a per-turn reward,
   and ``done``.

Observations are rendered into tokens once by the runtime (through the
model's chat template when it has one) and appended to the episode with loss
mask 0; sampled tokens are appended as the engine returned them, with loss
mask 1. One :class:`Environment` object serves one episode: the factory
registered by the plugin builds a fresh one per episode, so an environment
may keep per-episode state in ``self``.

Recovery (``EnvironmentFeatures.restore``): an environment that declares
``replay`` can be rebuilt mid-episode: a fresh object gets ``reset(record,
seed=...)`` and then ``step`` with each recorded :class:`Action` (the same
token ids and text), in order, and must answer with the same observations,
rewards and ``done=False`` as the first time (the runtime checks; a
difference fails the episode). The runtime does this when the episode's
environment was lost (its worker process exited or was restarted for another
episode's time-out); with ``reset`` (the default) such an episode starts again
from ``reset`` instead, its sampled turns thrown away.

Errors: an exception from ``reset`` or ``step``, a step over its time limit,
or an episode over its turn or token limit ends that episode as a recorded
failure with a reason (the run goes on). Raise
:class:`asyncflow_core.errors.EnvironmentFailure` with a one-line reason meant for the user.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncflow_core.interfaces.features import Features

#: ``EnvironmentFeatures.restore`` values
RESTORE_RESET = "reset"  #: an environment cannot be rebuilt mid-episode: a lost one means the episode starts over
RESTORE_REPLAY = "replay"  #: ``reset`` + the recorded actions rebuild it, with the same observations


class EnvironmentFeatures(Features):
    owns_reward: bool = Field(
        False,
        description="The episode's reward is the sum of the per-step rewards the environment returns; "
        "off: a `reward` plugin scores the final text and step rewards are only logged.",
    )
    deterministic: bool = Field(
        True, description="With the same record, seed and actions, reset/step return the same observations."
    )
    blocking: bool = Field(
        False,
        description="Steps may block the event loop or hold the GIL (CPU-bound tools, blocking I/O): "
        "the runtime runs such environments in worker processes.",
    )
    restore: Literal["reset", "replay"] = Field(
        RESTORE_RESET,
        description="How an episode whose environment was lost (its worker process exited or was restarted) or "
        "whose turns must be re-based goes on. replay: a fresh environment gets reset(record, seed) and step() of "
        "every recorded action, in order, and must return the same observations, rewards and done=False (checked: "
        "a difference fails the episode with a reason); the episode keeps its turns. reset: it starts again from "
        "reset, its sampled turns thrown away. replay needs deterministic and steps whose effects are safe to "
        "repeat (they are run again).",
    )

    @model_validator(mode="after")
    def _replay_is_deterministic(self) -> EnvironmentFeatures:
        if self.restore == RESTORE_REPLAY and not self.deterministic:
            raise ValueError("restore='replay' needs deterministic=True: replaying the recorded actions must give "
                             "the recorded observations")
        return self


@dataclass(frozen=True)
class ToolSpec:
    """A typed, documented callable an environment exposes (OpenAI function-tool shape)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  #: JSON schema of the arguments (``{"type": "object", "properties": ...}``)

    def as_openai(self) -> dict[str, Any]:
        """The entry for a chat template's ``tools=`` argument (and the OpenAI API)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class Observation:
    """What the environment shows the policy. Exactly one of the three forms is set.

    - ``messages``: chat messages (``{"role": "user"|"tool"|"system", "content": ...}``), rendered by the
      model's chat template; on reset the generation prompt is added, on step the messages are appended
      after the policy's turn with the generation prompt for its next one;
    - ``text``: plain text, encoded once by the run's tokenizer (character tokenizer or a model without a
      chat template);
    - ``token_ids``: already tokens, appended as they are.
    """

    messages: Sequence[Mapping[str, Any]] | None = None
    text: str | None = None
    token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        n = sum(x is not None for x in (self.messages, self.text, self.token_ids))
        if n != 1:
            raise ValueError("an Observation carries exactly one of messages=, text= or token_ids=")


@dataclass(frozen=True)
class Action:
    """One turn the policy sampled: its tokens as the engine returned them, and their text (decoded once)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  #: 'stop' (a stop token/EOS ended the turn) or 'length' (the turn hit its token limit)
    turn: int  #: 0-based index of this turn in the episode


@dataclass(frozen=True)
class Step:
    observation: Observation | None  #: the next observation; None only when ``done``
    reward: float = 0.0  #: this turn's reward (the episode's reward when the environment owns it)
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)  #: logged per episode (tool names, tool_ok, ...)

    def __post_init__(self) -> None:
        if not self.done and self.observation is None:
            raise ValueError("a Step that is not done must carry the next observation")


class Environment(abc.ABC):
    """One episode's environment. Built fresh per episode by the registered factory."""

    @property
    @abc.abstractmethod
    def features(self) -> EnvironmentFeatures: ...

    @property
    def tools(self) -> Sequence[ToolSpec]:
        """Tools offered to the policy (passed to the chat template's ``tools=`` on reset). Default: none."""
        return ()

    @abc.abstractmethod
    async def reset(self, record: Mapping[str, Any], *, seed: int) -> Observation:
        """Start an episode from a dataset row; the first observation is the prompt.

        ``record`` is the dataset row as a mapping: the :class:`~asyncflow_core.types.PromptRecord`'s
        ``metadata`` keys (the answer, a chat in ``messages``, ...) with ``prompt``, ``index`` and
        ``prompt_token_ids`` beside them (a nested ``metadata`` mapping should be accepted too). ``seed`` makes a
        stochastic environment replayable.
        Raise (any exception) for a row the environment cannot use: the episode fails with that reason.
        """

    @abc.abstractmethod
    async def step(self, action: Action) -> Step:
        """Apply the policy's turn; return the next observation, this turn's reward and whether it is over.

        Any text the policy can write must be answered: a malformed tool call is an observation saying what
        was wrong (and ``info["tool_ok"] = False``, ``info["reason"]``), not an exception. Exceptions are for
        the environment's own faults; ``info`` must be JSON-serialisable (it is logged).
        """

    async def close(self) -> None:  # noqa: B027 - optional
        """Release what the episode held (processes, files). Called once, also after a failure."""


#: Builds one environment per episode, called with no arguments (the plugin's registered factory with its validated
#: options bound, e.g. ``lambda: record.factory(options)``); what the environment pool takes.
EnvironmentFactory = Callable[[], Environment | Awaitable[Environment]]
