"""Rewards computed by models, each served by its own replicas: ``model`` (two forms) and ``combined``.

``model`` with ``form: classifier`` scores a (prompt, completion) pair with a
sequence-classification reward model (``AutoModelForSequenceClassification``
loaded from a local directory; exactly one output label). ``form: judge``
sends a prompt template to a generative judge served by a rollout engine
plugin (``torch``, ``vllm``, ...) and parses the verdict from its answer.

Both score whole batches (the reward stage hands ``score_many`` a lease's
samples at once): the classifier in padded batches of ``batch_size`` on its
``replicas`` model copies, the judge as one request per sample over its
engine replicas (an :class:`~asyncflow_core.flow.engine_pool.EnginePool`:
most free slots first, ``max_inflight`` each). A batch not scored within the
reward's ``timeout_s`` fails its samples; a judge replica that raises is
marked dead and its samples fail; when every judge replica is dead, samples
fail at once. A failed sample is recorded and dropped like any failed reward:
the run goes on.

The judge's weights are its own (loaded from ``judge.model_path``); they never
follow the policy's published versions (a frozen weight policy).

``combined`` is a weighted sum of other rewards (a rule such as ``math_verify``
plus a ``model`` term, say); each term's value is logged beside the sum.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.errors import ConfigError
from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import RewardBackend, hookimpl
from asyncflow_core.types import FinishReason, GenerationRequest, RewardInput, SamplingParams

log = logging.getLogger("asyncflow.reward")

DEFAULT_JUDGE_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Is the answer correct? Reply with one word: yes or no."
)


class JudgeConfig(BaseModel):
    """The generative judge: a rollout engine plugin serving a local checkpoint."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        description="Local Hugging Face checkpoint of the judge (with tokenizer and chat template).")
    engine: str = Field("torch", description="Rollout engine plugin serving the judge (torch, vllm, ...).")
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of that engine (its `model` is set from model_path).")
    replicas: int = Field(1, ge=1, description="Judge engine replicas.")
    max_inflight: int = Field(32, ge=1, description="Most judge requests one replica works on at once.")
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="Prompt sent to the judge, a format string over {prompt}, {completion} and metadata fields "
        "(e.g. {answer}); rendered as one user message by the judge's chat template.",
    )
    verdicts: dict[str, float] = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        description="Verdict words and their rewards; the first one found in the judge's answer (case-insensitive, "
        "whole word) is the score. An answer with none fails the sample.",
    )
    max_new_tokens: int = Field(16, ge=1, description="Cap on the judge's answer tokens.")
    temperature: float = Field(0.01, gt=0, description="Judge sampling temperature (small: near-greedy).")


class ModelRewardConfig(BaseModel):
    """Options of ``model``."""

    model_config = ConfigDict(extra="forbid")

    form: Literal["classifier", "judge"] = Field(
        description="classifier: a sequence-classification reward model; judge: a generative judge.")
    path: str | None = Field(None, description="classifier: local AutoModelForSequenceClassification directory.")
    device: str = Field("cpu", description="classifier: torch device of the reward model (cuda:1, ...).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="classifier: parameter dtype.")
    replicas: int = Field(1, ge=1, description="classifier: model copies scoring batches concurrently.")
    batch_size: int = Field(16, ge=1, description="classifier: sequences per forward pass.")
    max_length: int = Field(2048, ge=8, description="classifier: longer (prompt, completion) pairs are truncated.")
    chat_template: bool = Field(
        True, description="classifier: render the pair as a user/assistant chat with the reward model's template "
        "when it has one (else prompt + completion as text).")
    scale: float = Field(1.0, description="The score is scale * output + shift.")
    shift: float = Field(0.0, description="See scale.")
    judge: JudgeConfig | None = Field(None, description="judge: the judge engine and its prompt.")

    @model_validator(mode="after")
    def _form_fields(self) -> ModelRewardConfig:
        if self.form == "classifier" and not self.path:
            raise ValueError("reward.options.form classifier needs reward.options.path (a local reward model)")
        if self.form == "judge" and self.judge is None:
            raise ValueError("reward.options.form judge needs reward.options.judge (model_path, engine, template)")
        return self


# ------------------------------------------------------------------------------------------- classifier


def _check_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what} {path!r} is not a Hugging Face checkpoint directory (no config.json)")
    return p


class ClassifierReward(Reward):
    """A sequence-classification reward model; its one output logit (scaled) is the reward."""

    def __init__(self, config: ModelRewardConfig) -> None:
        from transformers import AutoConfig  # type: ignore[import-not-found]

        self.config = config
        path = _check_dir(config.path or "", "reward.options.path")
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        labels = int(getattr(hf_config, "num_labels", 0) or 0)
        if labels != 1:
            raise ConfigError(f"reward.options.path {config.path!r}: the reward model has {labels} output labels; a "
                              "reward model scores with exactly one (num_labels=1), so use a reward model, not a "
                              "classifier with several classes")
        self._models: asyncio.Queue | None = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # type: ignore[import-not-found]

        cfg = self.config
        tok = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        models = []
        for _ in range(cfg.replicas):
            m = AutoModelForSequenceClassification.from_pretrained(
                cfg.path, local_files_only=True, dtype=getattr(torch, cfg.dtype)).to(cfg.device).eval()
            if m.config.pad_token_id is None:  # batched scoring finds each sequence's last token by the pad id
                m.config.pad_token_id = tok.pad_token_id
            models.append(m)
        self._tokenizer = tok
        self._models = asyncio.Queue()
        for m in models:
            self._models.put_nowait(m)

    def _text(self, s: RewardInput) -> str:
        tok = self._tokenizer
        if self.config.chat_template and getattr(tok, "chat_template", None):
            chat = [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.completion}]
            return tok.apply_chat_template(chat, tokenize=False)
        return s.prompt + s.completion

    def _forward(self, model: Any, texts: list[str]) -> list[float]:
        import torch

        cfg = self.config
        out: list[float] = []
        for i in range(0, len(texts), cfg.batch_size):
            enc = self._tokenizer(texts[i:i + cfg.batch_size], return_tensors="pt", padding=True, truncation=True,
                                  max_length=cfg.max_length).to(cfg.device)
            with torch.no_grad():
                logits = model(**enc).logits.float()
            out.extend((logits[:, 0] * cfg.scale + cfg.shift).tolist())
        return out

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        if self._models is None:
            await asyncio.to_thread(self._load)
        assert self._models is not None
        texts = [self._text(s) for s in samples]
        model = await self._models.get()
        try:
            values = await asyncio.wait_for(asyncio.to_thread(self._forward, model, texts), timeout_s)
        except TimeoutError:
            return [(False, f"reward model timed out after {timeout_s}s")] * len(samples)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the run goes on
            return [(False, f"reward model failed: {type(exc).__name__}: {exc}")] * len(samples)
        finally:
            self._models.put_nowait(model)
        return [(True, v) for v in values]

    async def score(self, sample: RewardInput) -> float:
        ok, value = (await self.score_many([sample], 3600.0))[0]
        if not ok:
            raise RuntimeError(value)
        return value


# ------------------------------------------------------------------------------------------------ judge


def parse_verdict(text: str, verdicts: Mapping[str, float]) -> float | None:
    """The reward of the first verdict word in ``text`` (whole word, case-insensitive), or None."""
    best: tuple[int, float] | None = None
    for word, value in verdicts.items():
        m = re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", text, re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), value)
    return None if best is None else best[1]


class JudgeReward(Reward):
    """A generative judge on its own engine replicas; the verdict in its answer is the reward."""

    def __init__(self, config: ModelRewardConfig) -> None:
        from asyncflow_core.config.models import ModelConfig
        from asyncflow_core.plugins import PluginKind, get_plugin_manager

        assert config.judge is not None
        self.config = config
        judge = config.judge
        _check_dir(judge.model_path, "reward.options.judge.model_path")
        try:
            judge.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"reward.options.judge.template does not format with prompt, completion and answer "
                              f"({exc!r}); write '{{{{' for a literal brace") from None
        pm = get_plugin_manager()
        record = pm.lookup(PluginKind.ROLLOUT_ENGINE, judge.engine).record
        self._model = ModelConfig(path=judge.model_path)
        opts = {**judge.engine_options}
        if "model" in record.config_model.model_fields:
            opts["model"] = self._model
        self._options = pm.validate_options(PluginKind.ROLLOUT_ENGINE, judge.engine, opts,
                                            where="reward.options.judge.engine_options")
        self._factory = record.factory
        self._pool: Any = None
        self._tokenizer: Any = None
        self._sampling: SamplingParams | None = None
        self._start_lock = asyncio.Lock()
        self._seq = 0

    async def _start(self) -> None:
        from asyncflow_core.flow.engine_pool import EnginePool
        from asyncflow_core.flow.tokenizer import make_tokenizer, stop_token_ids

        async with self._start_lock:
            if self._pool is not None:
                return
            judge = self.config.judge
            assert judge is not None
            self._tokenizer = make_tokenizer(self._model)
            self._sampling = SamplingParams(max_new_tokens=judge.max_new_tokens, temperature=judge.temperature,
                                            stop_token_ids=stop_token_ids(self._model, self._tokenizer))
            engines = [self._factory(self._options) for _ in range(judge.replicas)]
            for e in engines:
                await e.start()
            self._pool = EnginePool(engines, max_inflight=judge.max_inflight)

    def _prompt_ids(self, s: RewardInput) -> tuple[int, ...]:
        judge = self.config.judge
        assert judge is not None
        fields = {k: v for k, v in s.metadata.items() if isinstance(k, str)}
        text = judge.template.format_map({**fields, "prompt": s.prompt, "completion": s.completion})
        if getattr(self._tokenizer.hf, "chat_template", None):
            return tuple(self._tokenizer.render([{"role": "user", "content": text}], "judge prompt"))
        return tuple(self._tokenizer.encode(text))

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        await self._start()
        judge = self.config.judge
        assert judge is not None and self._sampling is not None
        answers: list[tuple[bool, Any]] = [(False, "not scored")] * len(samples)
        todo = list(range(len(samples)))
        pool = self._pool
        drives = []
        while todo:
            aside: list[tuple[int, int]] = []
            per: dict[int, list[tuple[int, GenerationRequest]]] = {}
            left = []
            for i in todo:
                r = pool.next_replica(aside)
                if r is None:
                    left.append(i)
                    continue
                self._seq += 1
                try:
                    req = GenerationRequest(request_id=f"judge-{self._seq}",
                                            prompt_token_ids=self._prompt_ids(samples[i]), sampling=self._sampling)
                except Exception as exc:  # noqa: BLE001 - a template that does not fit this sample fails it
                    answers[i] = (False, f"judge prompt: {type(exc).__name__}: {exc}")
                    continue
                pool.assign(r, req.request_id, i)
                per.setdefault(r.index, []).append((i, req))
            pool.put_back(aside)
            drives += [asyncio.ensure_future(self._drive(pool[idx], reqs, answers, timeout_s))
                       for idx, reqs in per.items()]
            if pool.alive == 0:
                for i in left:
                    answers[i] = (False, f"every judge replica died (last: {pool.last_death})")
                break
            if left and drives:  # every replica full: wait for one batch, then place the rest
                await asyncio.wait(drives, return_when=asyncio.FIRST_COMPLETED)
                drives = [d for d in drives if not d.done()]
            elif left:  # full with another caller's requests
                await asyncio.sleep(0.01)
            todo = left
        if drives:
            await asyncio.gather(*drives)
        return answers

    async def _drive(self, r: Any, reqs: list[tuple[int, GenerationRequest]], answers: list[tuple[bool, Any]],
                     timeout_s: float) -> None:
        judge = self.config.judge
        assert judge is not None
        index = {req.request_id: i for i, req in reqs}

        async def consume() -> None:
            async for res in r.engine.generate([req for _, req in reqs]):
                i = index.get(res.request_id)
                if i is None or self._pool.release(r, res.request_id) is None:
                    continue
                if res.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    answers[i] = (False, f"judge: {res.error or res.finish_reason.value}")
                    continue
                ids = res.token_ids.tolist() if hasattr(res.token_ids, "tolist") else list(res.token_ids)
                text = self._tokenizer.decode(ids)
                value = parse_verdict(text, judge.verdicts)
                answers[i] = (True, value) if value is not None else (
                    False, f"judge answered {text[:80]!r}, with no verdict of {sorted(judge.verdicts)}")

        try:
            await asyncio.wait_for(consume(), timeout_s)
        except TimeoutError:
            late = [rid for rid in index if rid in r.inflight]
            for rid in late:
                self._pool.release(r, rid)
                answers[index[rid]] = (False, f"judge timed out after {timeout_s}s")
            if late and r.engine.features.supports_abort:
                try:
                    await r.engine.abort(late)
                except Exception:  # noqa: BLE001 - it may be the hung part
                    pass
        except Exception as exc:  # noqa: BLE001 - a failing replica fails its samples; the run goes on
            for i in self._pool.mark_dead(r, exc, restartable=False) or []:
                answers[i] = (False, f"judge replica {r.index} failed: {type(exc).__name__}: {exc}")
            log.error("judge replica %d died: %s: %s", r.index, type(exc).__name__, exc)
        for rid, i in index.items():  # a result the engine never sent
            if self._pool.release(r, rid) is not None:
                answers[i] = (False, "the judge engine returned no result for it")

    async def score(self, sample: RewardInput) -> float:
        ok, value = (await self.score_many([sample], 3600.0))[0]
        if not ok:
            raise RuntimeError(value)
        return value

    async def shutdown(self) -> None:
        if self._pool is not None:
            for r in self._pool:
                await r.engine.shutdown()


def make_model_reward(config: ModelRewardConfig) -> Reward:
    return ClassifierReward(config) if config.form == "classifier" else JudgeReward(config)


# --------------------------------------------------------------------------------------------- combined


class Term(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A reward plugin name (math_verify, model, ...).")
    options: dict[str, Any] = Field(default_factory=dict, description="Its options.")
    weight: float = Field(1.0, description="Its weight in the sum.")
    label: str | None = Field(None, description="Its name in the metrics (default: the plugin name).")


class CombinedConfig(BaseModel):
    """Options of ``combined``."""

    model_config = ConfigDict(extra="forbid")

    terms: list[Term] = Field(min_length=1, description="The rewards to add up, each with its weight.")


class CombinedReward(Reward):
    """sum(weight * term): every term scores every sample (batched when it can); any failed term fails the sample.

    Extra values a term returns (``answer_found``) are passed through, and each
    term's own value is reported as ``<label>``.
    """

    def __init__(self, config: CombinedConfig) -> None:
        from asyncflow_core.plugins import PluginKind, get_plugin_manager

        pm = get_plugin_manager()
        self.terms = []
        labels = []
        for j, term in enumerate(config.terms):
            if term.name == "combined":
                raise ConfigError(f"reward.options.terms[{j}]: a combined reward cannot contain another")
            record = pm.lookup(PluginKind.REWARD, term.name).record
            opts = pm.validate_options(PluginKind.REWARD, term.name, term.options,
                                       where=f"reward.options.terms[{j}].options")
            label = term.label or term.name
            if label in labels or label == "reward":
                raise ConfigError(f"reward.options.terms[{j}]: label {label!r} is taken; give each term its own label")
            labels.append(label)
            self.terms.append((label, term.weight, record.factory(opts)))

    @staticmethod
    async def _term(reward: Any, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        many = getattr(reward, "score_many", None)
        if callable(many):
            return list(await many(samples, timeout_s))
        out = []
        for s in samples:
            try:
                v = reward.score(s)
                if inspect.isawaitable(v):
                    v = await asyncio.wait_for(v, timeout_s)
                out.append((True, v))
            except TimeoutError:
                out.append((False, f"timed out after {timeout_s}s"))
            except Exception as exc:  # noqa: BLE001
                out.append((False, f"{type(exc).__name__}: {exc}"))
        return out

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        per_term = await asyncio.gather(*(self._term(r, samples, timeout_s) for _, _, r in self.terms))
        out: list[tuple[bool, Any]] = []
        for i in range(len(samples)):
            total, values, why = 0.0, {}, None
            for (label, weight, _), answers in zip(self.terms, per_term, strict=True):
                ok, v = answers[i]
                if not ok:
                    why = f"{label}: {v}"
                    break
                if isinstance(v, Mapping):
                    values.update({k: float(x) for k, x in v.items() if k != "reward"})
                    v = v["reward"]
                values[label] = float(v)
                total += weight * float(v)
            out.append((False, why) if why is not None else (True, {"reward": total, **values}))
        return out

    async def score(self, sample: RewardInput) -> Mapping[str, float]:
        ok, value = (await self.score_many([sample], 3600.0))[0]
        if not ok:
            raise RuntimeError(value)
        return value

    async def shutdown(self) -> None:
        for _, _, r in self.terms:
            if asyncio.iscoroutinefunction(getattr(r, "shutdown", None)):
                await r.shutdown()


@hookimpl
def asyncflow_rewards():
    yield RewardBackend(
        name="model",
        factory=make_model_reward,
        config_model=ModelRewardConfig,
        description="A reward model (sequence classification, 1 label) or a generative judge on its own engines.",
    )
    yield RewardBackend(
        name="combined",
        factory=CombinedReward,
        config_model=CombinedConfig,
        description="Weighted sum of other rewards (e.g. math_verify plus a model), each term logged.",
    )
