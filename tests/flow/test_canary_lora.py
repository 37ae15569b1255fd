"""A dropped LoRA adapter sync is caught by the weights canary, at the step it happens, every time.

The pieces are real: the ``torch`` rollout engine applying adapter-only updates (merged), a
trainer that trains a ``peft`` LoRA adapter with Adam (one step per version) and publishes
``adapter_state_dict`` as a partial update, and the :class:`Canary` checking every step. One
version's sync is dropped in one of two ways, the two that verl#7495-style silent staleness takes:

- ``engine``: the engine receives the update, bumps its version, but keeps the previous adapter
  (tokens claim version v and come from v-1);
- ``transport``: the update never reaches the engine (it stays at v-1).

Either must flag that step (``canary/flagged``; a mismatch for the first, ``canary/stale`` for the
second) and, with ``stop_above`` set, stop the run; no other step may be flagged. Over several
seeds and drop positions.
"""

from __future__ import annotations

import asyncio
import collections
import types
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.flow.canary import Canary  # noqa: E402
from asyncflow_core.flow.stage import RunStopped  # noqa: E402
from asyncflow_core.plugins import get_plugin_manager  # noqa: E402
from asyncflow_core.types import Batch, RaggedTensor, SamplingParams, pack_buckets  # noqa: E402
from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap  # noqa: E402
from asyncflow_core.types.sampling import sampling_logprobs  # noqa: E402
from asyncflow_plugins.hf.model import build_causal_lm  # noqa: E402

TINY = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 48,
    "max_position_embeddings": 512,
}
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)
STEPS = 6
#: a float32 engine and the trainer agree to ~1e-6 per token (float32 rounding of a tiny model); one Adam step
#: of lr 1e-2 on the adapter moves the log-probs by ~1e-2 (measured below, not assumed): 1e-3 sits between
WARN = 1e-3
PROMPTS = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Trainer:
    """A LoRA trainer: Adam on the adapter of a peft model, a supervised step per version, the canary's scorer."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = wrap(build_causal_lm(ModelConfig(hf_config=TINY)), SPEC)
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(seed)
        self.target = torch.randint(0, TINY["vocab_size"], (4, 12), generator=gen)
        self.version = 0

    def step(self) -> None:
        self.model.train()
        logits = self.model(input_ids=self.target).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.target[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.model.eval()
        self.version += 1

    def update(self):
        state = {n: t.detach().clone() for n, t in adapter_state_dict(self.model).items()}
        buckets = list(pack_buckets(state.items(), version=self.version, bucket_bytes=4 << 10))

        async def feed():
            for b in buckets:
                yield b

        return feed()

    async def compute_logprobs(self, batch: Batch) -> Batch:
        prompts, responses = batch[C.PROMPT_IDS], batch[C.RESPONSE_IDS]
        out = []
        with torch.no_grad():
            for i in range(batch.num_rows):
                p, r = prompts[i].tolist(), responses[i].tolist()
                logits = self.model(input_ids=torch.tensor([[*p, *r]])).logits[0, len(p) - 1: -1].float()
                lp = sampling_logprobs(logits, SAMPLING.temperature, SAMPLING.top_p, SAMPLING.top_k)
                out.append(lp.gather(1, torch.tensor(r)[:, None])[:, 0])
        return Batch({C.LOGPROBS: RaggedTensor.from_sequences(out)})


@dataclass
class Replica:
    index: int
    engine: object
    dead: bool = False


class Ctx:
    """What the canary uses of a FlowContext: counters and wait_for (polled; the test drives every change)."""

    def __init__(self) -> None:
        self.counters = collections.Counter()

    async def wait_for(self, predicate) -> None:
        while not predicate():
            await asyncio.sleep(0.01)


async def drill(seed: int, drop_at: int, how: str, stop_above: float | None) -> tuple[list[dict], str | None]:
    engine = get_plugin_manager().create("rollout_engine", "torch", {"model": {"hf_config": TINY}, "device": "cpu"})
    engine.configure_adapter(SPEC)
    await engine.start()
    trainer = Trainer(seed)
    ctx = Ctx()
    canary = Canary(every=1, samples=len(PROMPTS), warn_above=WARN, stop_above=stop_above,
                    replicas=[Replica(0, engine)], trainer=trainer, trainer_lock=asyncio.Lock(), sampling=SAMPLING,
                    engine_name="torch", deadline_s=0.5, adapter=True)
    canary.bind(ctx)
    batch = Batch({C.PROMPT_IDS: RaggedTensor.from_sequences([torch.tensor(p) for p in PROMPTS])})
    reports: list[dict] = []
    stopped = None
    try:
        for _ in range(STEPS):
            previous = {n: t.clone() for n, t in engine._adapter.params.items()}  # noqa: SLF001
            trainer.step()
            v = trainer.version
            if v == drop_at and how == "transport":
                pass  # the update never arrives
            elif v == drop_at and how == "engine":
                await engine.update_weights(v, trainer.update())
                with torch.no_grad():  # the defect: the version moves, the weights go back to the old adapter
                    for n, t in previous.items():
                        engine._adapter.params[n].copy_(t)  # noqa: SLF001
            else:
                await engine.update_weights(v, trainer.update())
            canary.published(types.SimpleNamespace(version=v, batch=batch))
            try:
                await canary.before_step(v)
            except RunStopped as exc:
                stopped = str(exc)
                reports.append({"step": v, "stopped": True})
                break
            reports.append({"step": v, **canary.take_metrics()})
    finally:
        await canary.close()
        await engine.shutdown()
    return reports, stopped


@pytest.mark.parametrize("how", ["engine", "transport"])
@pytest.mark.parametrize("seed,drop_at", [(0, 1), (1, 3), (2, 5), (3, 2)])
def test_a_dropped_adapter_sync_is_flagged_at_its_step_and_no_other(seed, drop_at, how):
    reports, stopped = asyncio.run(drill(seed, drop_at, how, stop_above=None))
    assert stopped is None and [r["step"] for r in reports] == list(range(1, STEPS + 1))
    for r in reports:
        assert r["canary/flagged"] == float(r["step"] == drop_at), r
        if r["step"] == drop_at and how == "transport":
            assert r["canary/stale"] == 1.0
        elif r["step"] == drop_at:
            assert r["canary/mean_abs_dlogp"] > 3 * WARN, r  # a clear margin, not a coin toss at the threshold
        else:
            assert r["canary/stale"] == 0.0 and r["canary/tokens"] > 0
            assert r["canary/mean_abs_dlogp"] < WARN / 50, r  # the synced steps agree to float32 rounding


@pytest.mark.parametrize("how", ["engine", "transport"])
def test_with_stop_above_the_dropped_sync_stops_the_run_naming_the_engine(how):
    reports, stopped = asyncio.run(drill(4, 2, how, stop_above=2 * WARN))
    assert reports[-1] == {"step": 2, "stopped": True}
    assert stopped is not None and "'torch'" in stopped
