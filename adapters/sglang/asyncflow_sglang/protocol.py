"""What the engine reads from and writes to an SGLang server, as pure functions (no I/O), checked against
SGLang 0.5.20 to 0.5.23 (``http_server.py``, ``io_struct.py``, ``tokenizer_manager.py``,
``sampling/sampling_params.py``, ``layers/sampler.py``, ``utils/weight_versions.py``).

Kept apart from the engine so each rule can be tested on its own.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow_core.errors import ConfigError, EngineError
from asyncflow_core.types import SamplingParams
from asyncflow_sglang.config import (
    SGLANG_INSTALL,
    SUPPORTED_SGLANG,
    UPDATE_SESSION_SINCE,
    SGLangRolloutConfig,
    parse_version,
    show_version,
    version_supported,
)

#: SGLang turns a temperature below this into greedy sampling (top_k 1, temperature 1) and then reports the
#: log-softmax of the unscaled logits (``sampling_params.py`` ``_SAMPLING_EPS``, ``sampler.py`` greedy branch).
GREEDY_BELOW = 1e-6
#: SGLang's default ``--sampling-mask-max-tokens`` (``arg_groups/fields/exec_.py``), when /server_info lacks it.
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096
#: Position of the storage device in the arguments ``torch.multiprocessing.reductions.reduce_tensor`` returns
#: for a CUDA tensor; SGLang's senders put the GPU's UUID there (``utils/patch_torch.py``
#: ``_REDUCE_TENSOR_ARG_DEVICE_INDEX``) and its receivers accept an index or a UUID.
CUDA_DEVICE_ARG = 6


@dataclass(frozen=True)
class ServerFacts:
    """What ``start()`` learned from /server_info and /model_info."""

    version: tuple[int, ...]
    version_text: str
    tp_size: int
    deterministic: bool
    memory_saver: bool
    sampling_mask_max_tokens: int
    weight_version: str | None

    @property
    def update_session(self) -> bool:
        """Weight updates go between /begin_weight_update and /end_weight_update (SGLang >= 0.5.21)."""
        return tuple(self.version[:3]) >= UPDATE_SESSION_SINCE


def server_facts(url: str, info: Any, model: Any, config: SGLangRolloutConfig) -> ServerFacts:
    """Check a server's /server_info and /model_info answers against ``config``; the facts the engine keeps.

    Raises EngineError for a server this adapter cannot drive, ConfigError when the options and the server
    disagree.
    """
    if not isinstance(info, dict):
        raise EngineError(f"{url}/server_info answered {str(info)[:200]!r}, not a JSON object; is this SGLang?")
    text = str(info.get("version", ""))
    version = parse_version(text)
    if version is None:
        raise EngineError(f"{url}/server_info did not report an SGLang version (got {text!r}); is this SGLang?")
    low, high = SUPPORTED_SGLANG
    if not version_supported(version) and not config.allow_unsupported_version:
        raise EngineError(
            f"SGLang {text} at {url} is outside the versions this adapter supports ({show_version(low)} to "
            f"{show_version(high)}); install one with {SGLANG_INSTALL}, or set allow_unsupported_version: true "
            "to try it anyway"
        )
    for name in ("dp_size", "pp_size"):
        size = int(info.get(name) or 1)
        if size > 1:
            raise ConfigError(
                f"the SGLang server at {url} runs {name} {size}: its weight-update group numbers ranks "
                "rank_offset + tp_rank and /init_weights_update_group asserts dp_size == 1, so weights cannot reach "
                f"it; start it with --{name.replace('_', '-')} 1 (one server per data-parallel copy)"
            )
    tp_size = int(info.get("tp_size") or 1)
    if config.world_size is not None and config.world_size != tp_size:
        raise ConfigError(
            f"world_size {config.world_size} does not match the server at {url}, which runs tp_size {tp_size}; "
            "leave world_size unset"
        )
    memory_saver = bool(info.get("enable_memory_saver", False))
    if config.memory_saver and not memory_saver:
        raise ConfigError(
            f"memory_saver: true, but the SGLang server at {url} runs without --enable-memory-saver; restart it "
            "with that flag or set memory_saver: false"
        )
    if isinstance(model, dict) and model.get("is_generation") is False:
        raise EngineError(f"the model served at {url} is not a generation model")
    weight_version = model.get("weight_version") if isinstance(model, dict) else None
    return ServerFacts(
        version=version,
        version_text=text,
        tp_size=tp_size,
        deterministic=bool(info.get("enable_deterministic_inference", False)),
        memory_saver=memory_saver,
        sampling_mask_max_tokens=int(info.get("sampling_mask_max_tokens") or DEFAULT_SAMPLING_MASK_MAX_TOKENS),
        weight_version=None if weight_version is None else str(weight_version),
    )


def truncated(sp: SamplingParams) -> bool:
    return sp.top_p < 1.0 or sp.top_k > 0


def renormalised(sp: SamplingParams, config: SGLangRolloutConfig) -> bool:
    """Whether the request asks SGLang for ``return_sampling_mask`` (renormalised selected log-probs)."""
    return config.truncated_logprobs == "renormalise" and truncated(sp)


def refusal(sp: SamplingParams, facts: ServerFacts, config: SGLangRolloutConfig) -> str | None:
    """Why a request with these sampling parameters cannot get asyncflow's log-probs from this server, or None."""
    if sp.temperature < GREEDY_BELOW:
        return (
            f"temperature={sp.temperature}: SGLang samples greedily below {GREEDY_BELOW:g} and then reports "
            "log-probs of the unscaled logits, not asyncflow's; use a temperature of at least 1e-6"
        )
    if sp.seed is not None and not facts.deterministic:
        return (
            f"seed={sp.seed}: SGLang ignores sampling_seed unless the server runs with "
            "--enable-deterministic-inference (launch.deterministic_inference: true); drop the seed or restart "
            "the server in that mode"
        )
    if not truncated(sp) or config.truncated_logprobs == "server":
        return None
    if config.truncated_logprobs == "refuse":
        return (
            f"top_p={sp.top_p}, top_k={sp.top_k}: SGLang's output_token_logprobs are not renormalised after "
            "top-k/top-p, which is not asyncflow's log-prob convention; sample with top_p=1 and top_k=-1, or set "
            "rollout.options.truncated_logprobs: renormalise (top-k) or server (SGLang's values)"
        )
    if sp.top_p < 1.0:
        return (
            f"top_p={sp.top_p}: SGLang cuts top-p on the distribution before top-k, asyncflow after it, so the "
            "renormalised log-probs would not match the trainer's; use top_k alone, or set "
            "rollout.options.truncated_logprobs: server to accept SGLang's values"
        )
    if sp.top_k > facts.sampling_mask_max_tokens:
        return (
            f"top_k={sp.top_k}: SGLang returns renormalised log-probs (return_sampling_mask) only for top_k up to "
            f"its --sampling-mask-max-tokens ({facts.sampling_mask_max_tokens}); lower top_k or raise that limit"
        )
    return None


def answer_tokens(meta: dict[str, Any], ids: Any, *, renormalise: bool) -> tuple[list[int], list[float]]:
    """Tokens and log-probs of one /generate answer's ``meta_info`` (ValueError with the reason otherwise).

    ``output_token_logprobs`` holds ``[logprob, token_id, text]`` triples (``LogprobEntry``); with
    ``return_sampling_mask`` the renormalised log-prob of each sampled token is
    ``output_token_sampling_logprobs[i]`` (one float per token in SGLang's default "selected" mode).
    """
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        # ValueError, like every malformed answer here: the caller turns it into the request's error result
        raise ValueError("it has no meta_info.output_token_logprobs (was return_logprob honoured?)")  # noqa: TRY004
    try:
        tokens = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
    except (TypeError, ValueError, IndexError):
        raise ValueError("its meta_info.output_token_logprobs are not [logprob, token_id, text] triples") from None
    if isinstance(ids, list) and [int(t) for t in ids] != tokens:
        raise ValueError("its output_ids and output_token_logprobs disagree")
    if renormalise:
        selected = meta.get("output_token_sampling_logprobs")
        if not isinstance(selected, list) or len(selected) != len(tokens):
            raise ValueError("it lacks one meta_info.output_token_sampling_logprobs entry per token "
                             "(was return_sampling_mask honoured?)")
        try:
            logprobs = [float(x[0] if isinstance(x, list) else x) for x in selected]
        except (TypeError, ValueError, IndexError):
            raise ValueError("its meta_info.output_token_sampling_logprobs are not numbers") from None
    return tokens, logprobs


def span_versions(spans: Any, count: int) -> list[str] | None:
    """The weight version that sampled each of ``count`` tokens, from ``meta_info.weight_versions``
    (``[{"version", "start", "end"}, ...]``, contiguous from 0); None when absent or malformed."""
    if not isinstance(spans, list) or not spans:
        return None
    names: list[str] = []
    try:
        for span in spans:
            start, end = int(span["start"]), int(span["end"])
            if start != len(names) or end < start:
                return None
            names += [str(span["version"])] * (end - start)
    except (KeyError, TypeError, ValueError):
        return None
    return names if len(names) == count else None


def with_device_uuid(args: tuple[Any, ...], uuid_of: Callable[[int], str]) -> tuple[Any, ...]:
    """``reduce_tensor``'s arguments for a CUDA tensor with the device index replaced by that GPU's UUID,
    as SGLang's senders write them: an index means another GPU in a process with other visible devices."""
    device = args[CUDA_DEVICE_ARG]
    if not isinstance(device, int):
        return args
    return (*args[:CUDA_DEVICE_ARG], uuid_of(device), *args[CUDA_DEVICE_ARG + 1:])


def _cuda_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)`` format: base64 of a
    ``ForkingPickler`` dump; CUDA tensors travel as IPC handles naming their GPU by UUID."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import init_reductions, reduce_tensor

    init_reductions()  # torch's tensor and storage reductions on ForkingPickler

    class _Pickler(ForkingPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                rebuild, args = reduce_tensor(obj)
                return rebuild, with_device_uuid(args, _cuda_uuid)
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")
