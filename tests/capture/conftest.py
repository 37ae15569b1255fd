"""Fixtures of the capture-endpoint tests: the local chat checkpoint, its tokenizer, and samplers."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.flow.tokenizer import make_tokenizer  # noqa: E402
from asyncflow_core.types import FinishReason, GenerationRequest, GenerationResult  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return build_local_chat_checkpoint(tmp_path_factory.mktemp("capture") / "ckpt")


@pytest.fixture
def tokenizer(checkpoint):
    """The runtime's tokenizer of the checkpoint (a fresh one per test: some tests change its template)."""
    return make_tokenizer(ModelConfig(path=str(checkpoint)))


class TorchSampler:
    """The ``torch`` rollout engine on the checkpoint as the endpoint's ``sample``, keeping every call."""

    def __init__(self, checkpoint: Path) -> None:
        from asyncflow_core.plugins import get_plugin_manager

        self.engine = get_plugin_manager().create(
            "rollout_engine", "torch", {"model": {"path": str(checkpoint)}, "device": "cpu", "max_batch": 4})
        self.calls: list[tuple[list[int], object, GenerationResult]] = []
        self.sent = 0

    async def __aenter__(self):
        await self.engine.start()
        return self

    async def __aexit__(self, *exc):
        await self.engine.shutdown()

    async def __call__(self, prompt_ids, sampling):
        self.sent += 1  # a request id unique among those in flight
        req = GenerationRequest(f"c{self.sent}", tuple(prompt_ids), sampling)
        [result] = [r async for r in self.engine.generate([req])]
        self.calls.append((list(prompt_ids), sampling, result))
        return result


class Scripted:
    """A sampler that replies with given token lists (log-prob -0.5 - i/100 for token i, a fixed version)."""

    def __init__(self, replies, *, version: int = 3, gate=None) -> None:
        self.replies = list(replies)
        self.version = version
        self.gate = gate  #: an awaitable factory run before each reply (to hold calls in flight)
        self.calls: list[tuple[list[int], object, GenerationResult]] = []

    async def __call__(self, prompt_ids, sampling):
        if self.gate is not None:
            await self.gate()
        tokens = self.replies.pop(0)
        if isinstance(tokens, BaseException):
            raise tokens
        finish = FinishReason.STOP if tokens and tokens[-1] in sampling.stop_token_ids else FinishReason.LENGTH
        result = GenerationResult(f"s{len(self.calls)}", tuple(prompt_ids), list(tokens),
                                  [-0.5 - i / 100 for i in range(len(tokens))], [self.version] * len(tokens), finish)
        self.calls.append((list(prompt_ids), sampling, result))
        return result


@pytest.fixture
def torch_sampler(checkpoint):
    return lambda: TorchSampler(checkpoint)


@pytest.fixture
def scripted():
    return Scripted
