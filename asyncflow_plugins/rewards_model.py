"""Rewards computed by models, each served by its own replicas: ``model`` (two forms) and ``combined``.

``model`` with ``form: classifier`` scores a (prompt, completion) pair with a
sequence-classification reward model (``AutoModelForSequenceClassification``
loaded from a local directory; exactly one output label). ``form: judge``
sends a prompt template to a generative judge served by a rollout engine
plugin (``torch``, ``vllm``, ...) and parses the verdict from its answer.

The model copies (classifier) and judge engines are a role of the run of
their own (:meth:`ModelRewardConfig.served_roles`, named ``reward_model``, or
``reward_model.<label>`` as a ``combined`` term): the launcher builds their
``replicas`` where ``placement`` says and hands them to the reward
(:meth:`serve`). Under ``local`` each replica runs in the run's process on
its ``placement.devices`` entry; under ``ray`` each is an actor of its own,
in its own placement group with ``placement.cpus`` / ``placement.gpus``,
built once for the run and replaced when it dies. Outside a launcher (a
reward built by hand) the reward builds its replicas in this process itself.

Both score whole batches (the reward stage hands ``score_many`` a lease's
samples at once): the classifier one batch per replica at a time, in padded
forward passes of ``batch_size``; the judge as one request per sample over
its engine replicas (an :class:`~asyncflow_core.flow.engine_pool.EnginePool`:
most free slots first, ``max_inflight`` each). A batch not scored within the
reward's ``timeout_s`` fails its samples. A replica that fails (its actor
died, its engine raised) fails the samples it held, is marked dead, and is
restarted when its launcher can (``ray``: up to ``launcher.options.max_restarts``
times); while none serves, samples wait for a restart within their timeout,
and once every replica is dead for good they fail at once. A failed sample
is recorded and dropped like any failed reward: the run goes on.

The replicas' weights are their own (``path``, ``judge.model_path``); they
never follow the policy's published versions (:attr:`WeightPolicy.FROZEN`).

``combined`` is a weighted sum of other rewards (a rule such as ``math_verify``
plus a ``model`` term, say); each term's value is logged beside the sum.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncflow_core.errors import ConfigError
from asyncflow_core.flow.reward_stage import score_each
from asyncflow_core.flow.roles import Placement, RoleSpec, WeightPolicy, instance_options
from asyncflow_core.interfaces import Reward
from asyncflow_core.plugins import RewardBackend, hookimpl
from asyncflow_core.types import FinishReason, GenerationRequest, RewardInput, SamplingParams

log = logging.getLogger("asyncflow.reward")

DEFAULT_JUDGE_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Is the answer correct? Reply with one word: yes or no."
)

#: the role of a ``model`` reward's replicas (``reward_model.<label>`` for a ``combined`` term)
ROLE = "reward_model"
_DEVICE = r"^(cpu|auto|mps|cuda(:\d+)?)$"


class JudgeConfig(BaseModel):
    """The generative judge: a rollout engine plugin serving a local checkpoint."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        description="Local Hugging Face checkpoint of the judge (with tokenizer and chat template).")
    engine: str = Field("torch", description="Rollout engine plugin serving the judge (torch, vllm, ...).")
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of that engine (its `model` is set from model_path).")
    replicas: int | None = Field(
        None, ge=1, description="Judge engine replicas: the older spelling of reward.options.replicas (give one).")
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


class ReplicaPlacement(BaseModel):
    """Where a reward model's replicas run: devices under ``local``, reserved resources under ``ray``."""

    model_config = ConfigDict(extra="forbid")

    devices: list[str] | None = Field(
        None,
        description="local launcher: the device of each replica, one entry per replica (e.g. [cuda:1, cuda:2]); "
        "unset: every replica on `device` (classifier) or the engine's own device option (judge). Ignored by ray.")
    cpus: float = Field(1.0, ge=0, description="ray launcher: CPUs reserved per replica actor.")
    gpus: float = Field(
        0.0, ge=0,
        description="ray launcher: GPUs reserved per replica actor (Ray sets its CUDA_VISIBLE_DEVICES; the replica "
        "runs on cuda). 0: it runs on CPU.")

    @model_validator(mode="after")
    def _devices(self) -> ReplicaPlacement:
        for d in self.devices or ():
            if not re.match(_DEVICE, d):
                raise ValueError(f"placement.devices entry {d!r} is not a device; write cpu, cuda, cuda:N or auto")
        return self


class ModelRewardConfig(BaseModel):
    """Options of ``model``."""

    model_config = ConfigDict(extra="forbid")

    form: Literal["classifier", "judge"] = Field(
        description="classifier: a sequence-classification reward model; judge: a generative judge.")
    path: str | None = Field(None, description="classifier: local AutoModelForSequenceClassification directory.")
    device: str = Field("cpu", pattern=_DEVICE,
                        description="classifier: torch device of every replica (cuda:1, ...) unless placement.devices "
                        "names one per replica; under ray a replica with placement.gpus runs on its own GPU.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="classifier: parameter dtype.")
    replicas: int = Field(1, ge=1, description="Replicas of the reward model (classifier copies, judge engines).")
    placement: ReplicaPlacement = Field(
        default_factory=ReplicaPlacement, description="Devices (local) or resources (ray) of each replica.")
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
        if self.judge is not None and self.judge.replicas is not None:
            if "replicas" in self.model_fields_set and self.replicas != self.judge.replicas:
                raise ValueError(f"reward.options.replicas={self.replicas} and judge.replicas={self.judge.replicas} "
                                 "disagree; give the replica count once, as reward.options.replicas")
            self.replicas = self.judge.replicas
        devices = self.placement.devices
        if devices is not None and len(devices) != self.replicas:
            raise ValueError(f"reward.options.placement.devices names {len(devices)} devices for {self.replicas} "
                             "replicas; give one device per replica (or set replicas to match)")
        return self

    def served_roles(self, *, serves: str = "reward", name: str = ROLE) -> tuple[RoleSpec, ...]:
        """The role of this reward's replicas (see :mod:`asyncflow_core.flow.roles`): one record, ``replicas``
        instances, frozen weights, placed by ``placement``."""
        p = self.placement
        placement = Placement(cpus=p.cpus, gpus=p.gpus, devices=tuple(p.devices or ()))
        if self.form == "classifier":
            interface, factory = "reward_model", ClassifierReplica
            options: BaseModel = ReplicaOptions(reward=self, device=self.device)
        else:
            assert self.judge is not None
            interface = "rollout"  # a judge replica is a rollout engine whose weights never change
            factory, options = judge_engine(self.judge)
        return (RoleSpec(name, serves, interface, count=self.replicas, weights=WeightPolicy.FROZEN, resources=name,
                         placement=placement, serves=serves, factory=factory, options=options),)


def judge_engine(judge: JudgeConfig) -> tuple[Any, BaseModel]:
    """The rollout engine plugin's factory and validated options that serve ``judge`` (``model`` set)."""
    from asyncflow_core.config.models import ModelConfig
    from asyncflow_core.plugins import PluginKind, get_plugin_manager

    pm = get_plugin_manager()
    record = pm.lookup(PluginKind.ROLLOUT_ENGINE, judge.engine).record
    opts = {**judge.engine_options}
    if "model" in record.config_model.model_fields:
        opts["model"] = ModelConfig(path=judge.model_path)
    options = pm.validate_options(PluginKind.ROLLOUT_ENGINE, judge.engine, opts,
                                  where="reward.options.judge.engine_options")
    return record.factory, options


class _Features(BaseModel):
    """What a dispatcher asks of a replica: whether it can be replaced after a failure."""

    supports_restart: bool = False


class _ServedPool:
    """The replicas of a ``model`` reward as an :class:`EnginePool`, with the waiting and restarts around it.

    ``changed`` is set (and replaced) whenever a replica frees a slot or
    comes back, so a caller with nothing to dispatch to waits for that, not
    for a poll.
    """

    def __init__(self, replicas: list[Any], *, max_inflight: int, what: str) -> None:
        from asyncflow_core.flow.engine_pool import EnginePool

        self.pool = EnginePool(replicas, max_inflight=max_inflight, name=what)
        self.what = what
        self.changed = asyncio.Event()
        self._restarts: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start every replica; one that fails to start is marked dead (and restarted when it can be).

        Replicas in other processes (a launcher's actors, ``out_of_process``)
        start together; those in this process one after another, as two
        Hugging Face loads in one process at once are not safe.
        """
        async def one(r: Any) -> None:
            try:
                await r.engine.start()
            except Exception as exc:  # noqa: BLE001 - dead from the start; its samples fail with the reason
                self.failed(r, exc)

        remote = {r.index for r in self.pool if getattr(r.engine, "out_of_process", False)}
        await asyncio.gather(*(one(r) for r in self.pool if r.index in remote))
        for r in self.pool:
            if r.index not in remote:
                await one(r)

    def next_replica(self, aside: list[tuple[int, int]]) -> Any:
        """The pool's next replica for new work, or None; a replica its launcher already knows is lost (an actor
        whose heartbeat failed, ``lost``) is failed here instead, so no batch is sent to it."""
        while True:
            r = self.pool.next_replica(aside)
            lost = None if r is None else getattr(r.engine, "lost", None)
            if lost is None:
                return r
            self.failed(r, lost)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_change(self, until: float) -> bool:
        """Wait for a freed slot or a restarted replica until loop time ``until``; False when time ran out."""
        left = until - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), left)
        return True

    def none_serving(self) -> str | None:
        """Why nothing can be dispatched for good (every replica dead, none restarting), else None."""
        if self.pool.all_dead():
            return f"every {self.what} replica died (last: {self.pool.last_death})"
        return None

    def failed(self, r: Any, exc: BaseException) -> list[Any]:
        """``r`` failed with ``exc``: mark it dead, restart it in the background when it can be; its orphans."""
        restartable = self.pool.restartable(r)
        orphans = self.pool.mark_dead(r, exc, restartable=restartable)
        if orphans is None:
            return []
        log.error("%s replica %d failed: %s: %s%s", self.what, r.index, type(exc).__name__, exc,
                  "; restarting it" if restartable else "")
        if restartable:
            task = asyncio.ensure_future(self._restart(r))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)
        self.notify()
        return orphans

    async def _restart(self, r: Any) -> None:
        async def started(replica: Any) -> None:
            pass  # a restarted replica starts with its own (frozen) weights: nothing to load

        await self.pool.restart(r, started, span=lambda lane, name: contextlib.nullcontext())
        self.notify()

    async def close(self) -> None:
        for t in list(self._restarts):
            t.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        for r in self.pool:
            with contextlib.suppress(Exception):
                await r.engine.shutdown()


# ------------------------------------------------------------------------------------------- classifier


def _check_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what} {path!r} is not a Hugging Face checkpoint directory (no config.json)")
    return p


class ReplicaOptions(BaseModel):
    """Options of one classifier replica: the reward's options and the device its launcher put it on."""

    model_config = ConfigDict(extra="forbid")

    reward: ModelRewardConfig = Field(description="The reward's options.")
    device: str | None = Field(None, description="This replica's device (set by the launcher); unset: reward.device.")


class ClassifierReplica:
    """One copy of a sequence-classification reward model on one device: an instance of the ``reward_model`` role.

    It loads on :meth:`start` (in a thread) and scores whole batches; a
    forward pass that raises fails that batch's samples, while a replica
    that cannot load raises, so its dispatcher marks it dead.
    """

    features = _Features()

    def __init__(self, options: ReplicaOptions) -> None:
        self.config = options.reward
        self.device = options.device or options.reward.device
        self.pid = os.getpid()
        self._model: Any = None
        self._tokenizer: Any = None

    async def start(self) -> None:
        if self._model is None:
            await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # type: ignore[import-not-found]

        cfg = self.config
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"reward model device {self.device!r} was asked for but CUDA is not available here")
        tok = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, local_files_only=True, dtype=getattr(torch, cfg.dtype)).to(self.device).eval()
        if model.config.pad_token_id is None:  # batched scoring finds each sequence's last token by the pad id
            model.config.pad_token_id = tok.pad_token_id
        self._tokenizer, self._model = tok, model

    def _text(self, s: RewardInput) -> str:
        tok = self._tokenizer
        if self.config.chat_template and getattr(tok, "chat_template", None):
            chat = [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.completion}]
            return tok.apply_chat_template(chat, tokenize=False)
        return s.prompt + s.completion

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        cfg = self.config
        out: list[float] = []
        for i in range(0, len(texts), cfg.batch_size):
            enc = self._tokenizer(texts[i:i + cfg.batch_size], return_tensors="pt", padding=True, truncation=True,
                                  max_length=cfg.max_length).to(self.device)
            with torch.no_grad():
                logits = self._model(**enc).logits.float()
            out.extend((logits[:, 0] * cfg.scale + cfg.shift).tolist())
        return out

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        """``(True, score)`` per sample, or ``(False, why)`` for each when the forward pass raised."""
        await self.start()
        try:
            values = await asyncio.to_thread(self._forward, [self._text(s) for s in samples])
        except Exception as exc:  # noqa: BLE001 - the batch fails, the replica and the run go on
            return [(False, f"reward model failed: {type(exc).__name__}: {exc}")] * len(samples)
        return [(True, v) for v in values]

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None:
        self._model = self._tokenizer = None


class ClassifierReward(Reward):
    """A sequence-classification reward model on its replicas; its one output logit (scaled) is the reward."""

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
        self.role = ROLE
        self._served: list[Any] | None = None
        self._replicas: _ServedPool | None = None
        self._start_lock = asyncio.Lock()
        self._ids = itertools.count()

    def serve(self, name: str, instances: Sequence[Any]) -> None:
        """Score on ``instances`` (the launcher's replicas of role ``name``) instead of copies built here."""
        self.role, self._served = name, list(instances)

    @property
    def replicas(self) -> list[Any]:
        """The replicas scoring (once started): in-process :class:`ClassifierReplica` s or a launcher's proxies."""
        return [] if self._replicas is None else [r.engine for r in self._replicas.pool]

    async def _start(self) -> None:
        async with self._start_lock:
            if self._replicas is not None:
                return
            if self._served is None:  # no launcher placed them: copies in this process, on placement.devices
                spec = self.config.served_roles(name=self.role)[0]
                self._served = [spec.factory(instance_options(spec, i)) for i in range(spec.count)]
            sp = _ServedPool(self._served, max_inflight=1, what="reward model")  # a copy scores one batch at a time
            await sp.start()
            self._replicas = sp

    async def score_many(self, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        await self._start()
        sp = self._replicas
        assert sp is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        n = len(samples)
        while True:
            aside: list[tuple[int, int]] = []
            r = sp.next_replica(aside)
            sp.pool.put_back(aside)
            if r is not None:
                break
            why = sp.none_serving()
            if why is not None:
                return [(False, why)] * n
            if not await sp.wait_change(until):  # every replica busy (or restarting) for the whole timeout
                return [(False, f"reward model timed out after {timeout_s}s (no replica was free)")] * n
        batch = f"batch-{next(self._ids)}"
        sp.pool.assign(r, batch, batch)
        try:
            answers = await asyncio.wait_for(r.engine.score_many(list(samples), timeout_s),
                                             max(until - loop.time(), 1e-3))
            return [(bool(ok), v) for ok, v in answers]
        except TimeoutError:
            return [(False, f"reward model timed out after {timeout_s}s")] * n
        except Exception as exc:  # noqa: BLE001 - the replica failed (its actor died, it cannot load): its samples fail
            sp.failed(r, exc)
            return [(False, f"reward model replica {r.index} failed: {type(exc).__name__}: {exc}")] * n
        finally:
            sp.pool.release(r, batch)
            sp.notify()

    async def score(self, sample: RewardInput) -> float:
        ok, value = (await self.score_many([sample], 3600.0))[0]
        if not ok:
            raise RuntimeError(value)
        return value

    async def shutdown(self) -> None:
        if self._replicas is not None:
            await self._replicas.close()


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
    """A generative judge on its engine replicas (the ``reward_model`` role); the verdict in its answer is the
    reward."""

    def __init__(self, config: ModelRewardConfig) -> None:
        from asyncflow_core.config.models import ModelConfig

        assert config.judge is not None
        self.config = config
        judge = config.judge
        _check_dir(judge.model_path, "reward.options.judge.model_path")
        try:
            judge.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"reward.options.judge.template does not format with prompt, completion and answer "
                              f"({exc!r}); write '{{{{' for a literal brace") from None
        self._model = ModelConfig(path=judge.model_path)
        self._factory, self._options = judge_engine(judge)
        self.role = ROLE
        self._served: list[Any] | None = None
        self._replicas: _ServedPool | None = None
        self._pool: Any = None
        self._tokenizer: Any = None
        self._sampling: SamplingParams | None = None
        self._start_lock = asyncio.Lock()
        self._seq = 0

    def serve(self, name: str, instances: Sequence[Any]) -> None:
        """Judge on ``instances`` (the launcher's engine replicas of role ``name``) instead of engines built here."""
        self.role, self._served = name, list(instances)

    async def _start(self) -> None:
        from asyncflow_core.flow.tokenizer import make_tokenizer, stop_token_ids

        async with self._start_lock:
            if self._pool is not None:
                return
            judge = self.config.judge
            assert judge is not None
            self._tokenizer = make_tokenizer(self._model)
            self._sampling = SamplingParams(max_new_tokens=judge.max_new_tokens, temperature=judge.temperature,
                                            stop_token_ids=stop_token_ids(self._model, self._tokenizer))
            if self._served is None:  # no launcher placed them: engines in this process, on placement.devices
                spec = self.config.served_roles(name=self.role)[0]
                self._served = [self._factory(instance_options(spec, i)) for i in range(spec.count)]
            sp = _ServedPool(self._served, max_inflight=judge.max_inflight, what="judge")
            await sp.start()
            self._replicas, self._pool = sp, sp.pool

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
        judge, sp = self.config.judge, self._replicas
        assert judge is not None and self._sampling is not None and sp is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        answers: list[tuple[bool, Any]] = [(False, "not scored")] * len(samples)
        todo = list(range(len(samples)))
        pool = self._pool
        drives: list[asyncio.Future] = []
        while todo:
            aside: list[tuple[int, int]] = []
            per: dict[int, list[tuple[int, GenerationRequest]]] = {}
            left = []
            for i in todo:
                r = sp.next_replica(aside)
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
            if not left:
                break
            why = sp.none_serving()
            if why is None:  # every replica full (ours or another caller's requests) or restarting: wait for one
                if drives:
                    await asyncio.wait(drives, timeout=max(until - loop.time(), 0),
                                       return_when=asyncio.FIRST_COMPLETED)
                    drives = [d for d in drives if not d.done()]
                    waited = loop.time() < until
                else:
                    waited = await sp.wait_change(until)
                if not waited:
                    why = f"judge timed out after {timeout_s}s (no replica was free)"
            if why is not None:
                for i in left:
                    answers[i] = (False, why)
                break
            todo = left
        if drives:
            await asyncio.gather(*drives)
        return answers

    async def _drive(self, r: Any, reqs: list[tuple[int, GenerationRequest]], answers: list[tuple[bool, Any]],
                     timeout_s: float) -> None:
        judge = self.config.judge
        assert judge is not None and self._replicas is not None
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
            if late and not r.dead and r.engine.features.supports_abort:
                try:
                    await r.engine.abort(late)
                except Exception:  # noqa: BLE001 - it may be the hung part
                    pass
        except Exception as exc:  # noqa: BLE001 - a failing replica fails its samples; the run goes on
            for i in self._replicas.failed(r, exc):
                answers[i] = (False, f"judge replica {r.index} failed: {type(exc).__name__}: {exc}")
        for rid, i in index.items():  # a result the engine never sent
            if self._pool.release(r, rid) is not None:
                answers[i] = (False, "the judge engine returned no result for it")
        self._replicas.notify()

    async def score(self, sample: RewardInput) -> float:
        ok, value = (await self.score_many([sample], 3600.0))[0]
        if not ok:
            raise RuntimeError(value)
        return value

    async def shutdown(self) -> None:
        if self._replicas is not None:
            await self._replicas.close()


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

    def served_roles(self, *, serves: str = "reward") -> tuple[RoleSpec, ...]:
        """The roles of the terms' own replicas: a ``model`` term labelled ``rm`` is role ``reward_model.rm``."""
        from asyncflow_core.plugins import PluginKind, get_plugin_manager

        pm = get_plugin_manager()
        out: list[RoleSpec] = []
        for j, term in enumerate(self.terms):
            if term.name == "combined":
                continue  # refused when the reward is built, with its own message
            opts = pm.validate_options(PluginKind.REWARD, term.name, term.options,
                                       where=f"reward.options.terms[{j}].options")
            declare = getattr(opts, "served_roles", None)
            if callable(declare):
                out.extend(declare(serves=serves, name=_term_role(term)))
        return tuple(out)


def _term_role(term: Term) -> str:
    return f"{ROLE}.{term.label or term.name}"


class CombinedReward(Reward):
    """sum(weight * term): every term scores every sample (batched when it can); any failed term fails the sample.

    Extra values a term returns (``answer_found``) are passed through, and each
    term's own value is reported as ``<label>``; both are declared (``extras``),
    so each is a store column and a per-step metric.
    """

    def __init__(self, config: CombinedConfig) -> None:
        from asyncflow_core.plugins import PluginKind, get_plugin_manager

        pm = get_plugin_manager()
        self.terms = []
        self._by_role: dict[str, Any] = {}  #: served role name -> the term's reward that uses it
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
            self._by_role[_term_role(term)] = self.terms[-1][2]
        #: declared extra values (store columns reward_extra/<key>): each term's value, then the terms' own extras
        from asyncflow_core.interfaces.features import reward_features

        extras = [label for label, _, _ in self.terms]
        for _, _, reward in self.terms:
            extras += [k for k in reward_features(reward).extras if k not in extras]
        self.extras = tuple(extras)

    def serve(self, name: str, instances: Sequence[Any]) -> None:
        """Hand a term's replicas (role ``reward_model.<label>``) to that term."""
        term = self._by_role.get(name)
        if term is None or not callable(getattr(term, "serve", None)):
            raise ValueError(f"combined reward: no term uses role {name!r} (terms: {sorted(self._by_role)})")
        term.serve(name, instances)

    @staticmethod
    async def _term(reward: Any, samples: Sequence[RewardInput], timeout_s: float) -> list[tuple[bool, Any]]:
        many = getattr(reward, "score_many", None)
        if callable(many):
            return list(await many(samples, timeout_s))
        return await score_each(reward, list(samples), timeout_s)

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
