"""One forward pass of a Hugging Face causal LM over a micro-batch of (prompt, response) rows.

Rows are right-padded into a rectangle and run without an attention mask:
with causal attention a real token never sees the padding after it, and
position ids start at 0 in every row, so each row's logits equal those of an
unpadded forward. Only the positions that predict response tokens are turned
into logits (``logits_to_keep``), then the shared log-prob convention
(temperature, top-k, top-p; :func:`asyncflow_core.types.sampling.sampling_logprobs`)
is applied in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncflow_core.types import RaggedTensor
from asyncflow_core.types.sampling import sampling_logprobs

PAD_ID = 0  #: filler after each row; never attended to by a real token (causal attention)


@dataclass(frozen=True)
class Layout:
    """Where every response token sits in the padded rectangle."""

    input_ids: torch.Tensor  #: [rows, longest] int64, right-padded
    keep: torch.Tensor  #: positions whose logits are computed (int64, ascending)
    row: torch.Tensor  #: per response token: its row
    column: torch.Tensor  #: per response token: index into ``keep`` of the position that predicts it
    position: torch.Tensor  #: per response token: the position that predicts it
    targets: torch.Tensor  #: per response token: its id


def layout(prompt_ids: RaggedTensor, response_ids: RaggedTensor) -> Layout:
    """Pack rows right-padded; locate the logits that score each response token."""
    p_len, r_len = prompt_ids.lengths, response_ids.lengths
    total = p_len + r_len
    rows = len(p_len)
    width = max(int(total.max()), 1) if rows else 1
    input_ids = torch.full((max(rows, 1), width), PAD_ID, dtype=torch.int64)
    for i in range(rows):
        p, r = int(p_len[i]), int(r_len[i])
        input_ids[i, :p] = prompt_ids.values[prompt_ids.offsets[i] : prompt_ids.offsets[i + 1]]
        input_ids[i, p : p + r] = response_ids.values[response_ids.offsets[i] : response_ids.offsets[i + 1]]
    row = torch.repeat_interleave(torch.arange(rows), r_len)
    # response token j of row i sits at p_i + j and is predicted by position p_i + j - 1
    within = torch.arange(response_ids.numel_packed) - torch.repeat_interleave(response_ids.offsets[:-1], r_len)
    position = torch.repeat_interleave(p_len, r_len) - 1 + within
    if position.numel():
        lo, hi = int(position.min()), int(position.max())
    else:
        lo, hi = 0, 0
    keep = torch.arange(lo, hi + 1)
    return Layout(input_ids, keep, row, position - lo, position, response_ids.values.to(torch.int64))


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (float32, with grad when enabled) of every response token, and values if ``value_head``.

    Both are 1-D, packed in the order of ``response_ids.values``.
    """
    input_ids = lay.input_ids.to(device)
    hidden: list[torch.Tensor] = []
    handle = None
    if value_head is not None:
        # the decoder's output is the final (normed) hidden state the LM head reads
        handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: hidden.append(out[0]))
    try:
        if keep_logits_supported:
            out = model(input_ids=input_ids, use_cache=False, logits_to_keep=lay.keep.to(device))
            logits = out.logits
            column = lay.column
        else:
            logits = model(input_ids=input_ids, use_cache=False).logits
            column = lay.position
    finally:
        if handle is not None:
            handle.remove()
    row, column = lay.row.to(device), column.to(device)
    picked = logits[row, column].float()
    logp = sampling_logprobs(picked, temperature, top_p, top_k)
    logp = logp.gather(1, lay.targets.to(device).unsqueeze(1)).squeeze(1)
    values = None
    if value_head is not None:
        h = hidden[0][row, lay.position.to(device)]
        values = value_head(h).squeeze(-1).float()
    return logp, values
