"""The oracle of the rollout spec: what an engine's log-probs must be, computed without the engine.

Two sources, tried in this order by :class:`~asyncflow_spec.RolloutEngineSpec`:

- a **Hugging Face reference** (:class:`HFReference`): for an engine that
  serves a Hugging Face causal LM (its options declare a ``model`` field,
  an ``asyncflow_core.config.models.ModelConfig``), the suite loads the same
  architecture with ``transformers`` and runs a full forward pass over
  prompt + completion (teacher forcing) in float64;
- a **scorer** (:class:`ScorerReference`): the spec subclass overrides
  ``reference_logprobs(prompt, completion, sampling, *, weights)``, for an
  engine whose policy is not a Hugging Face model (a bigram table, a toy).

Either way the log-prob of a sampled token is scored under the convention
of ``SamplingParams``: logits / temperature, then top-k, then top-p,
renormalised (``asyncflow_core.types.sampling.sampling_logprobs``).

Tolerances are derived, not picked: an engine computing in dtype ``d``
carries a rounding error on each logit of order ``eps(d) * |z|``, which the
temperature divides and the log-softmax at most doubles, so a returned
log-prob may differ from the float64 reference by
``LOGPROB_ULPS * eps(d) * (1 + max|z|) / T`` (:func:`logprob_tolerance`).
Positions where that error could flip a top-k / top-p cut (two logits within
the error of the k-th, or a cumulative mass within it of ``top_p``) cannot
be decided and are left out of the comparison.

The suite's own model (:func:`save_tiny_model`) is a tiny Llama built from a
config dict and saved with ``save_pretrained``: no hub, no tokenizer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncflow_core.types import GenerationResult, ModelTensors, SamplingParams
from asyncflow_core.types.sampling import sampling_logprobs

#: Rounding error of one returned log-prob, in units of ``eps(dtype) * (1 + max|logit|) / T``. A float32 engine
#: with a KV cache against the float64 full forward measures below 9 on the suite's model; 64 leaves a margin
#: while keeping the tolerance (~1e-4 at T = 0.6) four orders below what a convention error shifts (~0.1 to 1).
LOGPROB_ULPS = 64.0

#: Models above this many parameters are scored in float32, not float64 (memory); the tolerance adds its eps.
FLOAT64_MAX_PARAMS = 50_000_000

#: The suite's model: a tiny Llama with tied embeddings (as the arithmetic example), head_dim 64 (what vLLM's CPU
#: attention supports), a 256-position context (so the context-limit test is cheap), a wide init (peaked enough
#: that temperature, top-k and top-p each move log-probs far beyond the tolerance).
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
}


def _transformers() -> Any:
    import transformers

    return transformers


def build_config(hf_config: Mapping[str, Any]) -> Any:
    """A ``transformers`` config from a dict naming its ``model_type`` (``AutoConfig.for_model``)."""
    options = dict(hf_config)
    model_type = options.pop("model_type")
    return _transformers().AutoConfig.for_model(model_type, **options)


def random_model(config: Any, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The architecture of ``config`` with weights drawn from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return net.to(dtype).eval()


def save_tiny_model(directory: Path, *, seed: int = 0, prompt: Sequence[int] = (1, 2, 3),
                    hf_config: Mapping[str, Any] = TINY_LLAMA) -> Path:
    """Write the suite's model to ``directory`` with ``save_pretrained`` and return the directory.

    Its ``eos_token_id`` is the token the model most likely samples right
    after ``prompt``: an engine that ends completions on the model's EOS
    without being asked to (the request's ``stop_token_ids`` decide) is
    caught at the first token.
    """
    net = random_model(build_config(hf_config), seed)
    with torch.no_grad():
        greedy = int(net(input_ids=torch.tensor([list(prompt)])).logits[0, -1].argmax())
    for cfg in (net.config, net.generation_config):
        cfg.eos_token_id = greedy
    directory.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(str(directory))
    return directory


def trainer_export(net: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A model's tensors as the Hugging Face trainers (``fsdp``, ``megatron``) export them.

    ``state_dict`` names, every floating tensor in ``dtype``, and a tied
    group (``lm_head.weight`` = ``model.embed_tokens.weight``) sent once,
    under its first name.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in net.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        t = tensor.detach()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).clone()
    return out


def logprob_tolerance(dtype: torch.dtype, logit_scale: torch.Tensor | float, temperature: float) -> torch.Tensor:
    """How far a log-prob returned by an engine computing in ``dtype`` may be from the float64 reference.

    ``logit_scale`` is ``1 + max|logit|`` of the row the token was sampled
    from (the size of the quantity being rounded).
    """
    return torch.as_tensor(LOGPROB_ULPS * torch.finfo(dtype).eps * logit_scale / temperature, dtype=torch.float64)


@dataclass(frozen=True)
class Scored:
    """The reference for one completion: per-token log-prob, tolerance and whether the position is decidable."""

    logprobs: torch.Tensor  #: float64 [n]
    tolerance: torch.Tensor  #: float64 [n]
    decidable: torch.Tensor  #: bool [n]: a top-k / top-p cut there cannot flip within the tolerance


class Reference(abc.ABC):
    """What the rollout spec compares an engine with (see the module docstring)."""

    #: tokens are below this (None: unknown)
    vocab_size: int | None = None
    #: most positions (prompt + completion) the engine's model takes (None: no limit known)
    context_limit: int | None = None
    #: the reference already holds the weights the engine starts with (else the suite pushes its own first)
    knows_initial_weights: bool = False
    #: what the oracle is, for messages
    what: str = ""

    @abc.abstractmethod
    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Score with ``weights`` from now on (the tensors of an update the suite pushed to the engine)."""

    @abc.abstractmethod
    def score(self, prompt: Sequence[int], completion: Sequence[int], sampling: SamplingParams) -> Scored:
        """The reference log-probs of ``completion`` after ``prompt`` under ``sampling``, with tolerances."""

    @abc.abstractmethod
    def snapshot(self) -> Any:
        """The weights scored with now, for :meth:`restore` (to score one set of results under two versions)."""

    @abc.abstractmethod
    def restore(self, snapshot: Any) -> None:
        """Score with the weights of an earlier :meth:`snapshot` again."""

    def fresh_weights(self, seed: int) -> dict[str, torch.Tensor] | None:
        """A complete update of new values (trainer export format), or None when the suite cannot make one."""
        return None

    def save_model(self, directory: Path, seed: int) -> Path | None:
        """The same architecture with weights from ``seed``, saved for a trainer to load (None: not possible)."""
        return None


class HFReference(Reference):
    """A Hugging Face causal LM given as a ``ModelConfig`` mapping: ``path`` (local checkpoint) or ``hf_config``.

    From ``path`` the reference starts with the checkpoint's weights (the
    ones the engine loads); from ``hf_config`` the engine's random initial
    weights are its own, so the suite pushes known weights before comparing.
    """

    def __init__(self, model: Mapping[str, Any]) -> None:
        tf = _transformers()
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            str(model.get("dtype", "float32"))
        ]
        if model.get("path"):
            path = str(model["path"])
            self.config = tf.AutoConfig.from_pretrained(path, local_files_only=True,
                                                        trust_remote_code=bool(model.get("trust_remote_code")))
            net = tf.AutoModelForCausalLM.from_pretrained(path, config=self.config, dtype=torch.float32,
                                                          local_files_only=True,
                                                          trust_remote_code=bool(model.get("trust_remote_code")))
            self.knows_initial_weights = True
            self.what = f"a float64 forward pass of {path}"
        else:
            self.config = build_config(model["hf_config"])
            net = random_model(self.config, seed=0)
            self.what = "a float64 forward pass of the model's hf_config with the weights the suite pushed"
        params = sum(p.numel() for p in net.parameters())
        self.ref_dtype = torch.float64 if params <= FLOAT64_MAX_PARAMS else torch.float32
        self.net = net.to(self.ref_dtype).eval()
        self.tensors = ModelTensors.of(self.net.state_dict(keep_vars=True))
        self.vocab_size = int(self.net.get_output_embeddings().weight.shape[0])
        positions = getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)
        self.context_limit = int(positions) if positions else None

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self.tensors.specs))
        missing = self.tensors.missing(weights)
        if unknown or missing:
            raise AssertionError(
                f"the update the suite pushed does not fit the reference model: unknown names {unknown[:3]}, "
                f"missing {missing[:3]} (weights() must return the model's state_dict names)"
            )
        with torch.no_grad():
            # a tied group shares one tensor: loading any of its names sets all of them
            self.net.load_state_dict({k: v.to(self.ref_dtype) for k, v in weights.items()}, strict=False)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.net.load_state_dict(snapshot)

    @torch.no_grad()
    def score(self, prompt: Sequence[int], completion: Sequence[int], sampling: SamplingParams) -> Scored:
        tokens = [int(t) for t in completion]
        ids = torch.tensor([[*prompt, *tokens]])
        logits = self.net(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].to(torch.float64)
        logp = sampling_logprobs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        picked = logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        scale = 1.0 + logits.abs().amax(dim=1)
        tol = logprob_tolerance(self.dtype, scale, sampling.temperature)
        if self.ref_dtype != torch.float64:
            tol = tol + logprob_tolerance(self.ref_dtype, scale, sampling.temperature)
        return Scored(picked, tol, _decidable(logits, sampling, tol))

    def fresh_weights(self, seed: int) -> dict[str, torch.Tensor]:
        return trainer_export(random_model(self.config, seed), self.dtype)

    def save_model(self, directory: Path, seed: int) -> Path:
        net = random_model(self.config, seed, self.dtype)
        directory.mkdir(parents=True, exist_ok=True)
        net.save_pretrained(str(directory))
        return directory


Scorer = Callable[..., Any]


class ScorerReference(Reference):
    """The spec subclass's ``reference_logprobs(prompt, completion, sampling, *, weights)``.

    ``weights`` is None for the engine's initial weights, else the tensors of
    the last update the suite pushed. The scorer's log-probs are taken as
    exact; the tolerance is that of a float32 computation of the same
    numbers (``eps(float32) * (1 + |log-prob|) / min(T, 1)``).
    """

    knows_initial_weights = True

    def __init__(self, scorer: Scorer, *, vocab_size: int | None, context_limit: int | None) -> None:
        self.scorer = scorer
        self.weights: dict[str, torch.Tensor] | None = None
        self.vocab_size = vocab_size
        self.context_limit = context_limit
        self.what = "the spec class's reference_logprobs()"

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = {k: v.detach().clone() for k, v in weights.items()}

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        return self.weights

    def restore(self, snapshot: dict[str, torch.Tensor] | None) -> None:
        self.weights = snapshot

    def score(self, prompt: Sequence[int], completion: Sequence[int], sampling: SamplingParams) -> Scored:
        got = self.scorer(tuple(prompt), tuple(int(t) for t in completion), sampling, weights=self.weights)
        logp = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
        if logp.numel() != len(completion):
            raise AssertionError(f"reference_logprobs() returned {logp.numel()} values for {len(completion)} tokens")
        tol = logprob_tolerance(torch.float32, 1.0 + logp.abs(), min(sampling.temperature, 1.0))
        return Scored(logp, tol, torch.ones(logp.numel(), dtype=torch.bool))


def _decidable(logits: torch.Tensor, sampling: SamplingParams, tol: torch.Tensor) -> torch.Tensor:
    """Per row: False where the engine's rounding could flip which tokens top-k / top-p keep."""
    ok = torch.ones(logits.shape[0], dtype=torch.bool)
    scaled = logits / sampling.temperature
    # ``tol`` bounds the log-prob error, i.e. twice the error of one scaled logit: margins below use it as is
    if 0 < sampling.top_k < scaled.shape[-1]:
        top = torch.topk(scaled, sampling.top_k + 1, dim=-1).values
        ok &= (top[:, -2] - top[:, -1]) > tol
    if sampling.top_p < 1.0:
        logp = sampling_logprobs(logits, sampling.temperature, 1.0, sampling.top_k)
        probs = torch.sort(logp.exp(), dim=-1, descending=True).values
        before = probs.cumsum(-1) - probs  # mass ahead of each token: it is cut when that reaches top_p
        ok &= ((before - sampling.top_p).abs() > 2 * tol.unsqueeze(1)).all(dim=-1)
    return ok


@dataclass(frozen=True)
class Mismatch:
    """The worst disagreement between an engine's log-probs and the reference for a set of results."""

    compared: int  #: decidable tokens compared
    worst: float  #: largest |engine - reference| / tolerance (<= 1 passes)
    where: str  #: the request and position of the worst token, for the failure message


def compare(reference: Reference, results: Sequence[GenerationResult], sampling: SamplingParams,
            *, select: Callable[[GenerationResult, int], bool] | None = None) -> Mismatch:
    """Compare every decidable token of ``results`` (optionally those ``select(result, i)`` keeps)."""
    compared, worst, where = 0, 0.0, ""
    for res in results:
        tokens = [int(t) for t in _values(res.token_ids)]
        if not tokens:
            continue
        got = torch.tensor([float(x) for x in _values(res.logprobs)], dtype=torch.float64)
        ref = reference.score(res.prompt_token_ids, tokens, sampling)
        for i in range(len(tokens)):
            if not bool(ref.decidable[i]) or (select is not None and not select(res, i)):
                continue
            compared += 1
            if not torch.isfinite(ref.logprobs[i]) or not torch.isfinite(got[i]):
                ratio = 0.0 if ref.logprobs[i] == got[i] else float("inf")
            else:
                ratio = float((got[i] - ref.logprobs[i]).abs() / ref.tolerance[i])
            if ratio > worst:
                worst = ratio
                where = (f"request {res.request_id!r} token {i} (id {tokens[i]}): engine {float(got[i]):.6f}, "
                         f"reference {float(ref.logprobs[i]):.6f}, tolerance {float(ref.tolerance[i]):.2e}")
    return Mismatch(compared, worst, where)


def _values(seq: Any) -> list:
    return seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
