"""``stream=true`` on the capture endpoint, through the real ``openai`` client (sync and async).

A streamed call is sampled and recorded exactly as a non-streamed one and
only then cut into Server-Sent Events chunks, so the oracle is the
non-streamed call: under the same engine and seed, the episode recorded
from streamed calls is identical (tokens, log-probs, versions, loss mask,
turns), and what the SDK assembles from the chunks is the non-streamed reply.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from asyncflow_core.capture import CaptureServer
from asyncflow_core.capture.stream import token_texts
from asyncflow_core.types import SamplingParams

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
FOLLOW_UPS = ({"role": "tool", "tool_call_id": "call_0", "content": "7"}, {"role": "user", "content": "So?"}, None)


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def enc(tokenizer, text):
    return tokenizer.hf.encode(text, add_special_tokens=False)


def assemble(chunks):
    """A streamed chat reply as the agent rebuilds it: the message, finish reason, log-probs, usage, chunk count."""
    content, calls, logprobs, finish, usage, n = "", {}, [], None, None, 0
    for chunk in chunks:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                got = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
                got["function"]["name"] += call.function.name or ""
                got["function"]["arguments"] += call.function.arguments or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [c.logprob for c in choice.logprobs.content]
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, finish, logprobs, usage, n


def segments(traj):
    return [(s.token_ids, s.sampled, s.logprobs, s.versions, s.turn) for s in traj.segments]


def test_a_streamed_episode_is_identical_to_the_non_streamed_one_sync_and_async(tokenizer, torch_sampler):
    """The same three-turn agent thrice on a fresh, same-seeded torch engine: plain, async stream, sync stream."""
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(im_end,))
    start = [{"role": "system", "content": "You may call add."}, {"role": "user", "content": "What is 3 + 4?"}]
    ask = {"model": "policy", "tools": TOOLS, "logprobs": True}

    async def plain(session):
        messages, seen = list(start), []
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
            for follow_up in FOLLOW_UPS:
                r = await oai.chat.completions.create(messages=messages, **ask)
                c = r.choices[0]
                seen.append((c.message.content or "", c.finish_reason, [x.logprob for x in c.logprobs.content],
                             r.usage.model_dump()))
                messages.append(c.message.model_dump(exclude_none=True))
                if follow_up:
                    messages.append(follow_up)
        return seen

    async def streamed_async(session):
        messages, seen = list(start), []
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
            for follow_up in FOLLOW_UPS:
                stream = await oai.chat.completions.create(messages=messages, stream=True,
                                                           stream_options={"include_usage": True}, **ask)
                message, finish, logprobs, usage, n = assemble([c async for c in stream])
                seen.append((message["content"], finish, logprobs, usage))
                assert n > 2  # a role chunk, a chunk per token, the finish chunk, the usage chunk
                messages.append(message)
                if follow_up:
                    messages.append(follow_up)
        return seen

    def streamed_sync(session):  # the blocking client, in a thread beside the server's loop
        messages, seen = list(start), []
        with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
            for follow_up in FOLLOW_UPS:
                with oai.chat.completions.create(messages=messages, stream=True, **ask) as stream:
                    message, finish, logprobs, usage, _ = assemble(stream)
                assert usage is None  # include_usage was not asked for
                seen.append((message["content"], finish, logprobs, None))
                messages.append(message)
                if follow_up:
                    messages.append(follow_up)
        return seen

    async def episode(agent):
        async with torch_sampler() as engine, CaptureServer(engine, tokenizer, sampling=sampling) as server:
            session = server.open_session()
            seen = await (asyncio.to_thread(agent, session) if agent is streamed_sync else agent(session))
            return seen, await server.close_session(session), engine.calls

    (seen, ref, calls), (seen_a, got_a, _), (seen_s, got_s, _) = (
        asyncio.run(episode(agent)) for agent in (plain, streamed_async, streamed_sync))

    assert ref.status == "ok" and ref.turns == 3 and [s.sampled for s in ref.segments] == [1, 0, 1, 0, 1]
    assert sum(ref.loss_mask) == sum(len(c[2].token_ids) for c in calls)  # the engine's tokens, as returned
    for seen_x, got in ((seen_a, got_a), (seen_s, got_s)):
        assert got.prompt_ids == ref.prompt_ids and segments(got) == segments(ref)
        assert got.loss_mask == ref.loss_mask and got.response_ids == ref.response_ids
        assert got.sampled_versions() == ref.sampled_versions()
        assert {k: v for k, v in got.info.items() if k != "session"} == {
            k: v for k, v in ref.info.items() if k != "session"}
        # what the SDK assembled is the non-streamed reply: text, finish reason, every log-prob
        assert [x[:3] for x in seen_x] == [x[:3] for x in seen]
    assert [x[3] for x in seen_a] == [x[3] for x in seen]  # the usage chunk


def test_streamed_tool_calls_and_completions_assemble_to_the_plain_answers(tokenizer, scripted):
    """Scripted replies: a tool call, a multi-byte text; /completions with log-probs; the SDK's stream helper."""
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    words = "Sum: 7 ✓ déjà"
    replies = [[*enc(tokenizer, call), im_end], [*enc(tokenizer, words), im_end], enc(tokenizer, " 3 + 4 = 7")]
    user = [{"role": "user", "content": "What is 3 + 4?"}]

    async def run(stream):
        sampler = scripted([list(r) for r in replies])
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                out = []
                for _ in range(2):
                    if stream:  # the SDK's own accumulator
                        async with oai.chat.completions.stream(model="policy", messages=user, tools=TOOLS,
                                                               logprobs=True) as s:
                            r = await s.get_final_completion()
                    else:
                        r = await oai.chat.completions.create(model="policy", messages=user, tools=TOOLS,
                                                              logprobs=True)
                    c = r.choices[0]
                    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
                    out.append((c.message.content or None, calls, c.finish_reason,
                                [x.logprob for x in c.logprobs.content]))
                if stream:
                    text, finish, lps, tokens, n = "", None, [], [], 0
                    chunks = await oai.completions.create(model="policy", prompt="What is", logprobs=1, stream=True,
                                                          stream_options={"include_usage": True})
                    async for chunk in chunks:
                        n += 1
                        for ch in chunk.choices:
                            text += ch.text
                            finish = ch.finish_reason or finish
                            lps += ch.logprobs.token_logprobs if ch.logprobs else []
                            tokens += ch.logprobs.tokens if ch.logprobs else []
                        usage = chunk.usage
                    out.append((text, finish, lps, tokens, usage.completion_tokens, n))
                else:
                    r = await oai.completions.create(model="policy", prompt="What is", logprobs=1)
                    c = r.choices[0]
                    out.append((c.text, c.finish_reason, c.logprobs.token_logprobs, c.logprobs.tokens,
                                r.usage.completion_tokens, len(replies[2]) + 1))
            return out, session.trajectories()

    plain, plain_branches = asyncio.run(run(False))
    streamed, branches = asyncio.run(run(True))
    assert plain[0][1] == [("add", {"a": 3, "b": 4})] and plain[0][2] == "tool_calls"
    assert plain[1][0] == words and plain[1][2] == "stop"
    assert streamed == plain
    assert [segments(t) for t in branches] == [segments(t) for t in plain_branches]


def test_token_texts_join_to_the_text_and_never_split_a_character(tokenizer):
    hf = tokenizer.hf
    for text in ("What is 3 + 4? The answer is 7.", "déjà vu ✓ — 数字 7", "<tool_call>{\"a\": 1}</tool_call>"):
        ids = enc(tokenizer, text)
        pieces = token_texts(ids, lambda t: hf.decode(list(t), skip_special_tokens=True), text)
        assert len(pieces) == len(ids) and "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
        assert sum(bool(p) for p in pieces) > 1  # really per token, not the whole-text fallback
    # a decoder that rewrites earlier text: the text whole, in the last token's piece
    assert token_texts([1, 2, 3], lambda t: "ab"[:len(t)] if len(t) < 3 else "AB!", "AB!") == ["", "", "AB!"]
    assert token_texts([], lambda t: "", "") == []


def test_stream_refusals_and_an_agent_that_hangs_up_mid_stream(tokenizer, scripted):
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    sampler = scripted([[*enc(tokenizer, "The answer is 7."), im_end], [*enc(tokenizer, "8"), im_end]])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            url, auth = f"{session.base_url}/chat/completions", {"Authorization": f"Bearer {session.api_key}"}
            good = {"model": "policy", "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
            async with aiohttp.ClientSession() as http:
                refused = []
                for change in ({"stream": "yes"}, {"stream_options": {"include_usage": True}},
                               {"stream": True, "stream_options": {"include_usage": "yes"}}):
                    async with http.post(url, json={**good, **change}, headers=auth) as resp:
                        refused.append((resp.status, (await resp.json())["error"]["message"]))
                async with http.post(url, json={**good, "stream": True}, headers=auth) as resp:
                    assert resp.status == 200 and resp.content_type == "text/event-stream"
                    first = await resp.content.readline()  # then hang up
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                again = await oai.chat.completions.create(**good)
            return refused, first, again, session.trajectories()

    refused, first, again, branches = asyncio.run(body())
    assert refused == [(400, "stream must be true or false, got 'yes'"),
                       (400, "stream_options is only allowed with stream=true"),
                       (400, 'stream_options must be an object like {"include_usage": true}')]
    assert first.startswith(b"data: {") and json.loads(first[6:])["object"] == "chat.completion.chunk"
    # the hung-up call was recorded (the engine sampled it); the session served the next one
    assert again.choices[0].message.content == "8" and len(sampler.calls) == 2
    assert len(branches) == 2 and branches[0].info["calls"] == 2
