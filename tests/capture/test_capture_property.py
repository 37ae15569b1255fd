"""Token fidelity of recorded sessions under random conversations (hypothesis), without HTTP.

Random turn counts, reply lengths, stop/length endings, special tokens inside
replies, and tool/user messages between turns. The oracle is the checkpoint's
ChatML written out by hand: every engine prompt must be the previous prompt,
the engine's tokens, and the rendered delta, and the recorded episode the
last prompt plus the last reply.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core.capture.recorder import CaptureSession, ChatCall, ChatRenderer, normalize_messages
from asyncflow_core.types import FinishReason, GenerationResult, SamplingParams

TEXT = st.text(alphabet="abcdefghij 0123456789+=?.\n", min_size=1, max_size=12)
TURN = st.tuples(
    st.lists(st.integers(0, 383), min_size=1, max_size=8),  # the reply's tokens (specials 0..2 included)
    st.booleans(),  # ends on <|im_end|>
    st.lists(st.tuples(st.sampled_from(["tool", "user"]), TEXT), min_size=1, max_size=2),  # what the agent adds
)


def chatml(messages, generation_prompt=True):
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return out + ("<|im_start|>assistant\n" if generation_prompt else "")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(question=TEXT, turns=st.lists(TURN, min_size=1, max_size=4))
def test_every_turn_boundary_is_the_engines_tokens_plus_the_rendered_delta(tokenizer, question, turns):
    hf = tokenizer.hf
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(im_end,))
    replies = [[*(t for t in toks if t != im_end), im_end] if stop else [t for t in toks if t != im_end] or [5]
               for toks, stop, _ in turns]
    prompts: list[list[int]] = []

    async def sample(prompt_ids, s):
        tokens = replies[len(prompts)]
        prompts.append(list(prompt_ids))
        finish = FinishReason.STOP if tokens[-1] == im_end else FinishReason.LENGTH
        return GenerationResult("r", tuple(prompt_ids), tokens, [-1.0] * len(tokens), [len(prompts)] * len(tokens),
                                finish)

    async def body():
        session = CaptureSession("s", "http://x", "k", renderer=ChatRenderer(tokenizer), sample=sample, model="m")
        messages = [{"role": "user", "content": question}]
        for k, (_, _, added) in enumerate(turns):
            resp = await session.chat(ChatCall(normalize_messages(messages), None, sampling))
            messages.append(resp["choices"][0]["message"])
            if k < len(turns) - 1:
                messages += [{"role": role, "content": text} for role, text in added]
        return await session.close()

    traj = asyncio.run(body())
    enc = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    assert prompts[0] == enc(chatml([("user", question)])) == list(traj.prompt_ids)
    for k in range(1, len(turns)):
        closing = "\n" if replies[k - 1][-1] == im_end else "<|im_end|>\n"
        delta = enc(closing + chatml(turns[k - 1][2]))
        assert prompts[k] == [*prompts[k - 1], *replies[k - 1], *delta]
    assert [*traj.prompt_ids, *traj.response_ids] == [*prompts[-1], *replies[-1]]
    assert traj.loss_mask.count(1) == sum(map(len, replies)) and traj.info["branches"] == 1
    assert traj.sampled_versions() == [k + 1 for k, r in enumerate(replies) for _ in r]
