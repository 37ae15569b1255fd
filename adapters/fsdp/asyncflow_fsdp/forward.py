"""One forward pass of a Hugging Face causal LM over a micro-batch of (prompt, response) rows.

Rows are right-padded into a rectangle and run without an attention mask:
with causal attention a real token never sees the padding after it, and
position ids start at 0 in every row, so each row's logits equal those of an
unpadded forward. Only the positions that predict response tokens reach the
LM head (``logits_to_keep``), and the shared log-prob convention
(temperature, top-k, top-p; :func:`asyncflow_core.types.sampling.sampling_logprobs`)
is applied in float32.

The head runs in chunks of tokens: for each chunk, hidden states -> logits
-> log-probs -> the target's log-prob, so the float32 ``[tokens, vocab]``
logits (600 KB per token at a 151,936-word vocabulary) exist for one chunk
at a time and never for the whole micro-batch. Under autograd, with more
than one chunk, each chunk is recomputed in backward
(``torch.utils.checkpoint``), so neither the logits nor their gradient is
kept between forward and backward; the price is one more head matmul per
chunk in backward. A single chunk is kept instead: the head is the
forward's last op and the backward's first, so keeping it raises no peak.
The chunked head stands in for the head's ``forward`` during the model's
own call, so FSDP sees the same forward as before (the head is part of the root unit). Models whose forward
changes the head's output (e.g. logit soft-capping) are found by a probe on
first use and take the whole-logits path.

Shared prompts (``layout(..., sharing=prompt_sharing(model))``): rows whose prompts
are the same (a GRPO group's n samples) can be laid out as one sequence per
prompt: the prompt once, then each row's response after it, with a 4-D
attention mask that lets a response see the prompt and its own earlier
tokens only, and position ids that continue each response from the
prompt's end. Every real token then sees exactly the keys at exactly the
positions it sees in the rectangle, so log-probs and gradients are the
rectangle's up to float rounding (the shared prompt's gradient is the sum
of the n copies'); the prompt's forward and backward run once instead of n
times. Only model types whose attention takes a custom 4-D mask as given
and whose positions come from ``position_ids`` alone
(:data:`PROMPT_SHARING_MODELS`, with ``sdpa`` or ``eager`` attention,
:func:`prompt_sharing`), and only when it makes the forward cheaper.

Gradient checkpointing (``model.gradient_checkpointing_enable``): Hugging
Face checkpoints a decoder layer only while that layer is in training mode,
and the engine scores in eval mode (no dropout). While grad is enabled,
:func:`score` marks the checkpointing layers themselves as training (their
own flag, not their children's, so dropout modules stay off); models whose
config asks for dropout are left alone, since a layer may read its own flag
for functional dropout.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from asyncflow_core.types import RaggedTensor
from asyncflow_core.types.sampling import sampling_logprobs

PAD_ID = 0  #: filler after each row; never attended to by a real token (causal attention)

#: float32 logits one chunk of the head may hold (tokens per chunk = this // (vocab * 4), at least 1): 64 MiB is
#: 110 tokens at Qwen2's 151,936-word vocabulary, wide enough for an efficient matmul
LOGITS_CHUNK_BYTES = 64 << 20

#: model types whose attention takes a custom 4-D mask as given (transformers' ``create_causal_mask`` returns a
#: 4-D mask unchanged: ``masking_utils._preprocess_mask_arguments``, transformers 5.24) and whose positions come
#: from ``position_ids`` alone (rotary embeddings): a shared-prompt layout scores on them as the rectangle does
PROMPT_SHARING_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral"})
#: attention implementations whose 4-D mask format :func:`_attention_mask` writes (sdpa: bool, True = attend;
#: eager: additive float, added to the scores before the softmax)
_MASK_FORMATS = frozenset({"sdpa", "eager"})

#: per model: whether its forward returns the LM head's output unchanged (the probe's answer, see score)
_HEAD_IS_LOGITS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PromptSharing:
    """What :func:`layout` needs to lay rows out with shared prompts for one model (see :func:`prompt_sharing`)."""

    max_width: int  #: the widest rectangle the shared layout may replace (a sliding attention window caps it)
    #: a token's work in the linear layers, in units of the attention's work per (query, key) pair (6 x hidden:
    #: ~12 h^2 multiply-adds per token against ~2 h per pair); prices the longer sequences of the shared layout
    token_cost: int


@dataclass(frozen=True)
class Layout:
    """Where every response token sits in the padded rectangle (or in the shared-prompt sequences)."""

    input_ids: torch.Tensor  #: [rows, longest - 1] int64, right-padded (no row needs its last token)
    keep: torch.Tensor  #: positions whose logits are computed (int64, ascending)
    row: torch.Tensor  #: per response token: its row of ``input_ids``
    column: torch.Tensor  #: per response token: index into ``keep`` of the position that predicts it
    position: torch.Tensor  #: per response token: the position (column of ``input_ids``) that predicts it
    targets: torch.Tensor  #: per response token: its id
    #: shared prompts only: each token's position id ([sequences, length] int64; None: 0.. in every row)
    position_ids: torch.Tensor | None = None
    #: shared prompts only: [sequences, 1, length, length] bool, True where a query may attend to a key
    #: (None: causal attention over the whole row)
    attention_mask: torch.Tensor | None = None


def layout(prompt_ids: RaggedTensor, response_ids: RaggedTensor, *, sharing: PromptSharing | None = None) -> Layout:
    """Pack rows right-padded; locate the logits that score each response token.

    A row's last token is left out of the rectangle: its logits would predict
    the token after the response, which nothing scores (causal attention, so
    no earlier position sees it either).

    With ``sharing`` (the model's :func:`prompt_sharing`), rows that share
    a prompt are laid out as one sequence per prompt (:func:`shared_layout`)
    when the rectangle is at most ``max_width`` wide and the shared layout is
    the cheaper forward; otherwise the rectangle.
    """
    p_len, r_len = prompt_ids.lengths, response_ids.lengths
    rows = len(p_len)
    width = max(int((p_len + r_len).max()) - 1, 1) if rows else 1
    if sharing is not None and width <= sharing.max_width and rows > 1:
        shared = shared_layout(prompt_ids, response_ids, width=width, token_cost=sharing.token_cost)
        if shared is not None:
            return shared
    input_ids = torch.full((max(rows, 1), width), PAD_ID, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(rows), r_len)
    # response token j of row i sits at p_i + j and is predicted by position p_i + j - 1
    within = torch.arange(response_ids.numel_packed) - torch.repeat_interleave(response_ids.offsets[:-1], r_len)
    position = torch.repeat_interleave(p_len, r_len) - 1 + within
    if rows:
        # every token's place in the rectangle at once: prompt tokens at 0.., response tokens after their prompt
        p_row = torch.repeat_interleave(torch.arange(rows), p_len)
        p_col = torch.arange(prompt_ids.numel_packed) - torch.repeat_interleave(prompt_ids.offsets[:-1], p_len)
        at_row, at_col = torch.cat([p_row, row]), torch.cat([p_col, position + 1])
        ids = torch.cat([prompt_ids.values.to(torch.int64), response_ids.values.to(torch.int64)])
        inside = at_col < width
        input_ids[at_row[inside], at_col[inside]] = ids[inside]
    if position.numel():
        lo, hi = int(position.min()), int(position.max())
    else:
        lo, hi = 0, 0
    keep = torch.arange(lo, hi + 1)
    return Layout(input_ids, keep, row, position - lo, position, response_ids.values.to(torch.int64))


def shared_layout(prompt_ids: RaggedTensor, response_ids: RaggedTensor, *, width: int,
                  token_cost: int) -> Layout | None:
    """One sequence per distinct prompt: the prompt, then each of its rows' responses (all but their last token);
    ``None`` when no prompt repeats, a prompt is empty, or the shared forward would not be the cheaper one.

    The forward's cost is priced as ``cells x (token_cost + sequence
    length)``: the linear layers per token plus the attention per (query,
    key) pair; ``width`` is the rectangle's.

    A row's response token j is predicted by the prompt's last position (j =
    0) or by the row's own token j - 1; the mask lets each token see the
    prompt and the earlier tokens of its own row, and its position id is the
    one it has in the rectangle, so it sees what it sees there. Padding
    attends to itself (no fully masked query row) and no real token sees it.
    """
    p_len = prompt_ids.lengths.to(torch.int64)
    r_len = response_ids.lengths.to(torch.int64)
    rows = p_len.numel()
    if rows < 2 or int(p_len.min()) < 1:
        return None
    p_max = int(p_len.max())
    # each row's prompt padded with -1 (no token id) plus its length: equal keys are equal prompts
    key = torch.full((rows, p_max + 1), -1, dtype=torch.int64)
    p_row = torch.repeat_interleave(torch.arange(rows), p_len)
    p_col = torch.arange(prompt_ids.numel_packed) - torch.repeat_interleave(prompt_ids.offsets[:-1], p_len)
    key[p_row, p_col] = prompt_ids.values.to(torch.int64)
    key[:, p_max] = p_len
    prompts, group = torch.unique(key, dim=0, return_inverse=True)
    n_seq = prompts.shape[0]
    if n_seq == rows:
        return None
    g_plen = prompts[:, p_max]
    added = (r_len - 1).clamp(min=0)  # tokens a row adds after its prompt (its response but the last token)
    seq_len = g_plen.clone().index_add_(0, group, added)
    length = int(seq_len.max())
    if n_seq * length * (token_cost + length) >= rows * width * (token_cost + width):
        return None
    # where each row's tokens start in its sequence: the prompt's end plus the earlier rows of the same prompt
    order = torch.argsort(group, stable=True)
    g_sorted, added_sorted = group[order], added[order]
    before = torch.cumsum(added_sorted, 0) - added_sorted
    first = torch.zeros(n_seq, dtype=torch.int64).scatter_reduce(0, g_sorted, before, "amin", include_self=False)
    start = torch.empty(rows, dtype=torch.int64)
    start[order] = before - first[g_sorted] + g_plen[g_sorted]

    input_ids = torch.full((n_seq, length), PAD_ID, dtype=torch.int64)
    position_ids = torch.zeros((n_seq, length), dtype=torch.int64)
    owner = torch.full((n_seq, length), -1, dtype=torch.int64)  # -1 padding, 0 the prompt, i + 1 row i's tokens
    in_prompt = torch.arange(p_max)[None, :] < g_plen[:, None]
    seq_of, col_of = in_prompt.nonzero(as_tuple=True)
    input_ids[seq_of, col_of] = prompts[seq_of, col_of]
    position_ids[seq_of, col_of] = col_of
    owner[seq_of, col_of] = 0
    t_row = torch.repeat_interleave(torch.arange(rows), r_len)
    within = torch.arange(response_ids.numel_packed) - torch.repeat_interleave(response_ids.offsets[:-1], r_len)
    targets = response_ids.values.to(torch.int64)
    is_input = within < r_len[t_row] - 1
    i_row, i_within = t_row[is_input], within[is_input]
    i_seq, i_col = group[i_row], start[i_row] + i_within
    input_ids[i_seq, i_col] = targets[is_input]
    position_ids[i_seq, i_col] = p_len[i_row] + i_within
    owner[i_seq, i_col] = i_row + 1
    query, seen = owner[:, :, None], owner[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = (causal & ((seen == 0) | (seen == query))) | torch.eye(length, dtype=torch.bool)

    seq = group[t_row]
    position = torch.where(within == 0, p_len[t_row] - 1, start[t_row] + within - 1)
    lo, hi = (int(position.min()), int(position.max())) if position.numel() else (0, 0)
    return Layout(input_ids, torch.arange(lo, hi + 1), seq, position - lo, position, targets,
                  position_ids=position_ids, attention_mask=mask[:, None])


def prompt_sharing(model: torch.nn.Module) -> PromptSharing | None:
    """Whether and how far ``model`` can score rows in a shared-prompt layout (``None``: never).

    Needs a model type of :data:`PROMPT_SHARING_MODELS` with ``sdpa`` or
    ``eager`` attention. A sliding attention window caps the width: within
    the window every query sees all its keys in either layout (the custom
    mask bypasses the model's own window).
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in PROMPT_SHARING_MODELS:
        return None
    if getattr(config, "_attn_implementation", None) not in _MASK_FORMATS:
        return None
    window = getattr(config, "sliding_window", None)  # qwen2/qwen3 set it to None when it is off
    return PromptSharing(max_width=window if isinstance(window, int) and window > 0 else sys.maxsize,
                         token_cost=6 * int(config.hidden_size))


def _attention_mask(model: torch.nn.Module, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The layout's bool mask in the format of ``model``'s attention (see :data:`_MASK_FORMATS`)."""
    mask = mask.to(device)
    if getattr(model.config, "_attn_implementation", None) == "eager":
        return torch.zeros(mask.shape, device=device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask


def score(
    model: torch.nn.Module,
    lay: Layout,
    *,
    device: torch.device,
    temperature: float,
    top_p: float,
    top_k: int,
    value_head: torch.nn.Module | None = None,
    keep_logits_supported: bool = True,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (float32, with grad when enabled) of every response token, and values if ``value_head``.

    Both are 1-D, packed in the order of ``response_ids.values``.
    ``chunk_bytes`` bounds the float32 logits of one chunk of the head
    (default :data:`LOGITS_CHUNK_BYTES`, read at call time); ``0`` computes
    the logits of every kept position at once (the reference path). Both
    give the same log-probs and gradients up to float32 rounding.
    """
    budget = LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if budget < 0:
        raise ValueError(f"chunk_bytes must be >= 0 (0: no chunks), got {chunk_bytes}")
    head = _output_head(model) if budget > 0 else None
    if head is not None and _head_is_logits(model, head, device, keep_logits_supported):
        chunk = max(1, budget // (4 * _vocab_size(model, head)))
        return _score_chunked(model, head, lay, device, (temperature, top_p, top_k), value_head,
                              keep_logits_supported, chunk)
    return _score_whole(model, lay, device, (temperature, top_p, top_k), value_head, keep_logits_supported)


# -- running the model -----------------------------------------------------------


def _run(model: torch.nn.Module, lay: Layout, device: torch.device, keep_logits_supported: bool,
         with_hidden: bool) -> tuple[Any, torch.Tensor | None, torch.Tensor]:
    """One model call: its output, the decoder's final hidden states if asked, and the column of each target."""
    input_ids = lay.input_ids.to(device)
    hidden: list[torch.Tensor] = []
    handle = None
    if with_hidden:
        # the decoder's output is the final (normed) hidden state the LM head reads
        handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: hidden.append(out[0]))
    shared: dict[str, torch.Tensor] = {}
    if lay.attention_mask is not None:  # a shared-prompt layout: its positions and mask
        assert lay.position_ids is not None
        shared = {"position_ids": lay.position_ids.to(device),
                  "attention_mask": _attention_mask(model, lay.attention_mask, device)}
    try:
        with _checkpointing(model):
            if keep_logits_supported:
                out = model(input_ids=input_ids, use_cache=False, logits_to_keep=lay.keep.to(device), **shared)
                column = lay.column
            else:
                out = model(input_ids=input_ids, use_cache=False, **shared)
                column = lay.position
    finally:
        if handle is not None:
            handle.remove()
    return out, (hidden[0] if hidden else None), column


@contextmanager
def _checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """With grad enabled, the layers that checkpoint (``gradient_checkpointing`` set) do so in eval mode too."""
    layers = []
    if torch.is_grad_enabled() and not _config_dropout(model):
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and not m.training]
    for m in layers:
        m.training = True  # this module only: `train()` would also switch on its children's dropout
    try:
        yield
    finally:
        for m in layers:
            m.training = False


def _config_dropout(model: torch.nn.Module) -> bool:
    """Whether the model's config sets any dropout probability above 0 (``*dropout*``, ``*pdrop*``)."""
    config = getattr(model, "config", None)
    fields = vars(config) if config is not None and hasattr(config, "__dict__") else {}
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in fields.items())


def _values(value_head: torch.nn.Module, hidden: torch.Tensor | None, lay: Layout,
            device: torch.device) -> torch.Tensor:
    assert hidden is not None
    h = hidden[lay.row.to(device), lay.position.to(device)]
    return value_head(h).squeeze(-1).float()


def _score_whole(model: torch.nn.Module, lay: Layout, device: torch.device, convention: tuple[float, float, int],
                 value_head: torch.nn.Module | None,
                 keep_logits_supported: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of every kept position at once, then the convention over all of them."""
    out, hidden, column = _run(model, lay, device, keep_logits_supported, value_head is not None)
    picked = out.logits[lay.row.to(device), column.to(device)].float()
    logp = _target_logprobs(picked, lay.targets.to(device), convention)
    values = _values(value_head, hidden, lay, device) if value_head is not None else None
    return logp, values


def _score_chunked(model: torch.nn.Module, head: torch.nn.Module, lay: Layout, device: torch.device,
                   convention: tuple[float, float, int], value_head: torch.nn.Module | None,
                   keep_logits_supported: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's call with :class:`_TargetLogprobs` standing in for the head's ``forward``."""
    column = lay.column if keep_logits_supported else lay.position
    stand_in = _TargetLogprobs(head, lay.row.to(device), column.to(device), lay.targets.to(device), convention,
                               chunk)
    with _standing_in(head, stand_in):
        out, hidden, _ = _run(model, lay, device, keep_logits_supported, value_head is not None)
    if out.logits is not stand_in.result:  # the probe said this cannot happen; say so loudly if it does
        raise RuntimeError(f"{type(model).__name__} changed its LM head's output; score it with chunk_bytes=0")
    values = _values(value_head, hidden, lay, device) if value_head is not None else None
    return stand_in.result, values


# -- the chunked head ----------------------------------------------------------------


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, convention: tuple[float, float, int]) -> torch.Tensor:
    temperature, top_p, top_k = convention
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1)


class _TargetLogprobs:
    """Stands in for the LM head's ``forward`` during one model call: it returns the float32 log-prob of each
    target token (1-D, in target order) instead of logits, computed ``chunk`` tokens at a time."""

    def __init__(self, head: torch.nn.Module, row: torch.Tensor, column: torch.Tensor, targets: torch.Tensor,
                 convention: tuple[float, float, int], chunk: int) -> None:
        self.head_forward = head.forward  # the head's own forward (taken before the stand-in shadows it)
        self.head_trains = any(p.requires_grad for p in head.parameters())
        self.row, self.column, self.targets = row, column, targets
        self.convention = convention
        self.chunk = chunk
        self.result: torch.Tensor | None = None

    def _piece(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _target_logprobs(self.head_forward(hidden).float(), targets, self.convention)

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = hidden_states[self.row, self.column]  # [targets, hidden]
        # recompute in backward only with more than one chunk: the head is the forward's last op and the backward's
        # first, so one chunk's logits kept (instead of recomputed) raise no peak, and the recompute (an extra head
        # forward and the checkpoint's hooks) is pure cost: a few per cent of the example's rank step
        recompute = (h.shape[0] > self.chunk and torch.is_grad_enabled()
                     and (h.requires_grad or self.head_trains))
        pieces = []
        for start in range(0, max(h.shape[0], 1), self.chunk):  # an empty pass still runs one (empty) chunk
            hc, tc = h[start : start + self.chunk], self.targets[start : start + self.chunk]
            if recompute:  # keep only the chunk's hidden states; its logits are recomputed in backward
                pieces.append(checkpoint(self._piece, hc, tc, use_reentrant=False))
            else:
                pieces.append(self._piece(hc, tc))
        self.result = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return self.result


@contextmanager
def _standing_in(head: torch.nn.Module, stand_in: Any) -> Iterator[None]:
    """``head.forward`` is ``stand_in`` inside (an instance attribute shadows the class's method)."""
    if "forward" in vars(head):
        raise RuntimeError(f"{type(head).__name__}.forward is already replaced on the instance")
    head.forward = stand_in
    try:
        yield
    finally:
        del head.forward


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def _vocab_size(model: torch.nn.Module, head: torch.nn.Module) -> int:
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.get_input_embeddings().weight.shape[0])


def _head_is_logits(model: torch.nn.Module, head: torch.nn.Module, device: torch.device,
                    keep_logits_supported: bool) -> bool:
    """Whether ``model``'s forward returns its head's output untouched (probed once per model, then cached).

    The probe is a one-token forward without grad, with a stand-in head that
    returns a marker: the marker must come back as ``logits``, unmodified.
    Every rank runs it on its first call, so collectives stay in step.
    """
    known = _HEAD_IS_LOGITS.get(model)
    if known is not None:
        return known
    marker = torch.zeros(1, device=device)

    def stand_in(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return marker

    probe = Layout(torch.full((1, 1), PAD_ID, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                   *(torch.zeros(0, dtype=torch.int64) for _ in range(4)))
    with torch.no_grad(), _standing_in(head, stand_in):
        out, _, _ = _run(model, probe, device, keep_logits_supported, with_hidden=False)
    answer = getattr(out, "logits", None) is marker and marker._version == 0 and not bool(marker.any())
    _HEAD_IS_LOGITS[model] = answer
    return answer
