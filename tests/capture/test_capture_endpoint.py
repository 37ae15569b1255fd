"""The capture endpoint, driven by the real ``openai`` client: token fidelity across turns, branches, concurrency.

The oracle for token fidelity is the engine's own record (every prompt it
was given and every token it returned) and the checkpoint's ChatML template
written out by hand: the recorded episode must be exactly the engine's tokens
plus the rendered deltas, at every turn boundary.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncflow_core.capture import CaptureServer, parse_tool_calls
from asyncflow_core.errors import ConfigError
from asyncflow_core.types import SamplingParams

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def client(session):
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def ids(tokenizer, name):
    return tokenizer.hf.convert_tokens_to_ids(name)


def enc(tokenizer, text):
    return tokenizer.hf.encode(text, add_special_tokens=False)


def chatml(*messages, generation_prompt=True):
    """The checkpoint's template, by hand."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return out + ("<|im_start|>assistant\n" if generation_prompt else "")


# ------------------------------------------------------------------------------------------ token fidelity


def test_three_turns_with_a_tool_message_record_exactly_what_the_engine_sampled(tokenizer, torch_sampler):
    im_end = ids(tokenizer, "<|im_end|>")
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(im_end,))

    async def body():
        async with torch_sampler() as engine, CaptureServer(engine, tokenizer, sampling=sampling) as server:
            session = server.open_session(metadata={"task": "add"})
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is 3 + 4?"}]
            replies = []
            async with client(session) as oai:
                for follow_up in ({"role": "tool", "tool_call_id": "call_0", "content": "7"},
                                  {"role": "user", "content": "The answer is 7."}, None):
                    resp = await oai.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                             max_tokens=6, temperature=0.3, logprobs=True)
                    replies.append(resp)
                    messages.append(resp.choices[0].message.model_dump(exclude_none=True))
                    if follow_up:
                        messages.append(follow_up)
            traj = await server.close_session(session)
            return engine.calls, replies, traj, messages

    calls, replies, traj, messages = asyncio.run(body())
    assert len(calls) == 3 and traj.turns == 3 and traj.status == "ok"
    hf = tokenizer.hf

    # turn 1: the chat template's ids, tools passed through (this template ignores them)
    first = hf.apply_chat_template(messages[:2], tools=TOOLS, add_generation_prompt=True, tokenize=True)
    first = list(first["input_ids"] if not isinstance(first, list) else first)
    assert calls[0][0] == first == list(traj.prompt_ids)
    assert first == enc(tokenizer, chatml(("system", messages[0]["content"]), ("user", messages[1]["content"])))

    # every later prompt = the previous prompt + the engine's tokens + the delta rendered after them
    sent = [("tool", "7"), ("user", "The answer is 7.")]
    segments = traj.segments
    assert [s.sampled for s in segments] == [True, False, True, False, True]
    for k in range(3):
        prompt, used, result = calls[k]
        sampled = list(result.token_ids)
        assert list(segments[2 * k].token_ids) == sampled  # the engine's tokens, never re-encoded
        assert list(segments[2 * k].logprobs) == list(result.logprobs)
        assert list(segments[2 * k].versions) == list(result.versions) == [0] * len(sampled)
        assert used.temperature == 1.0  # the run's sampling, not the agent's 0.3
        assert used.max_new_tokens == 6 and used.stop_token_ids == (im_end,)
        resp = replies[k]
        assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == len(sampled)
        assert [c.logprob for c in resp.choices[0].logprobs.content] == list(result.logprobs)
        stopped = bool(sampled) and sampled[-1] == im_end
        assert resp.choices[0].finish_reason == ("stop" if stopped else "length")
        assert resp.choices[0].message.content == hf.decode(sampled[:-1] if stopped else sampled,
                                                            skip_special_tokens=True)
        if k < 2:
            closing = "\n" if stopped else "<|im_end|>\n"
            delta = enc(tokenizer, closing + chatml(sent[k]))
            assert list(segments[2 * k + 1].token_ids) == delta
            assert calls[k + 1][0] == [*prompt, *sampled, *delta]  # byte-identical at the boundary
    last_prompt, _, last = calls[2]
    assert [*traj.prompt_ids, *traj.response_ids] == [*last_prompt, *last.token_ids]
    assert traj.loss_mask == tuple(int(s.sampled) for s in segments for _ in s.token_ids)
    assert sum(traj.loss_mask) == sum(len(c[2].token_ids) for c in calls)
    assert [s.turn for s in segments] == [0, 0, 1, 1, 2]
    info = traj.info
    assert info["calls"] == 3 and info["branches"] == 1 and info["branch_reason"] == "first call"
    assert info["sampling_overridden"] == 3 and info["metadata"] == {"task": "add"} and not info["errors"]


def test_a_tool_call_is_parsed_and_its_tokens_stay_as_sampled(tokenizer, scripted):
    """The model writes the call in its own spacing and key order; the template would render it differently."""
    im_end = ids(tokenizer, "<|im_end|>")
    call_text = '<tool_call>{"arguments":{"b":3,"a":2},"name":"add"}</tool_call>'
    replies = [[*enc(tokenizer, call_text), im_end], [*enc(tokenizer, "5"), im_end]]
    sampler = scripted(replies, version=4)

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            async with client(session) as oai:
                first = await oai.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                call = first.choices[0].message.tool_calls[0]
                args = json.loads(call.function.arguments)
                messages += [first.choices[0].message.model_dump(),  # None fields included, as some agents send
                             {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
                second = await oai.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            return first, second, await session.close()

    first, second, traj = asyncio.run(body())
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "add" and json.loads(msg.tool_calls[0].function.arguments) == {
        "a": 2, "b": 3}
    assert second.choices[0].message.content == "5" and second.choices[0].finish_reason == "stop"
    s = traj.segments
    assert [x.sampled for x in s] == [True, False, True]
    assert list(s[0].token_ids) == replies[0] and list(s[2].token_ids) == replies[1]
    # the end-of-turn token was sampled: only the template's newline after it is glue
    assert list(s[1].token_ids) == enc(tokenizer, "\n" + chatml(("tool", "5")))
    assert list(sampler.calls[1][0]) == [*traj.prompt_ids, *replies[0], *s[1].token_ids]
    assert traj.sampled_versions() == [4] * (len(replies[0]) + len(replies[1]))
    assert traj.info["tool_calls"] == 1 and traj.info["branches"] == 1 and traj.info["tool_call_parse_errors"] == 0


def test_tool_call_blocks_that_do_not_parse_stay_in_the_text():
    ok = parse_tool_calls('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert ok.content == "Let me add." and ok.errors == 0
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ok.calls] == [("add", {"a": 1})]
    broken = parse_tool_calls("<tool_call>{not json}</tool_call> and <tool_call>{\"name\": \"add\"")
    assert broken.calls == [] and broken.errors == 2 and broken.content.startswith("<tool_call>{not json}")
    assert parse_tool_calls("plain").calls == [] and parse_tool_calls("plain").errors == 0


# ------------------------------------------------------------------------------------------ branches


def test_an_edited_history_starts_a_new_branch_and_a_rewind_forks(tokenizer, scripted):
    im_end = ids(tokenizer, "<|im_end|>")
    a, b, c, d = ([*enc(tokenizer, str(k)), im_end] for k in (1, 2, 3, 4))
    sampler = scripted([a, b, c, d])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            user = {"role": "user", "content": "Count."}
            async with client(session) as oai:
                r1 = await oai.chat.completions.create(model="policy", messages=[user])
                reply1 = r1.choices[0].message.model_dump(exclude_none=True)
                await oai.chat.completions.create(
                    model="policy", messages=[user, reply1, {"role": "user", "content": "Again."}])
                # rewind: the same first reply, a different follow-up -> a fork sharing turn 0's tokens
                await oai.chat.completions.create(
                    model="policy", messages=[user, reply1, {"role": "user", "content": "Other."}])
                forked = session.trajectory()
                # an edit: the agent rewrites the model's reply -> a fresh branch, the reply is prompt now
                await oai.chat.completions.create(model="policy", messages=[
                    user, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "Go."}])
            return forked, session.trajectories(), await session.close()

    forked, branches, traj = asyncio.run(body())
    assert forked.info["branch"] == 1 and "forked from branch 0 after turn 0" in forked.info["branch_reason"]
    assert list(forked.segments[0].token_ids) == a and list(forked.segments[2].token_ids) == c
    assert list(forked.segments[1].token_ids) == enc(tokenizer, "\n" + chatml(("user", "Other.")))
    assert [len(t.segments) for t in branches] == [3, 3, 1]
    assert list(branches[0].segments[2].token_ids) == b  # the first branch keeps its own second turn
    assert traj.info["branch"] == 2 and traj.info["branches"] == 3
    assert "messages[1] (assistant) differs" in traj.info["branch_reason"]
    assert list(traj.prompt_ids) == enc(tokenizer, chatml(("user", "Count."), ("assistant", "edited"), ("user", "Go.")))
    assert [list(s.token_ids) for s in traj.segments] == [d] and traj.loss_mask == (1,) * len(d)


def test_a_reply_cut_by_max_tokens_gets_the_closing_marker_as_observed_tokens(tokenizer, scripted):
    cut = enc(tokenizer, "What is")  # no end-of-turn token: finish_reason length
    sampler = scripted([cut, [ids(tokenizer, "<|im_end|>")]])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            user = {"role": "user", "content": "Hi."}
            async with client(session) as oai:
                r = await oai.chat.completions.create(model="policy", messages=[user])
                assert r.choices[0].finish_reason == "length"
                await oai.chat.completions.create(model="policy", messages=[
                    user, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}])
            return await session.close()

    traj = asyncio.run(body())
    assert list(traj.segments[1].token_ids) == enc(tokenizer, "<|im_end|>\n" + chatml(("user", "Go on.")))
    assert traj.info["finish_reasons"] == ["length", "stop"] and traj.info["branches"] == 1


# ------------------------------------------------------------------------------------------ concurrency


def test_two_sessions_in_flight_at_once_are_recorded_apart(tokenizer, torch_sampler):
    arrived = asyncio.Event

    async def body():
        both = arrived()
        waiting = []

        async with torch_sampler() as engine:
            async def gate_sample(prompt, sampling):
                waiting.append(prompt)
                if len(waiting) == 2:
                    both.set()
                await asyncio.wait_for(both.wait(), 120)  # both sessions' first calls are in flight together
                return await engine(prompt, sampling)

            async with CaptureServer(gate_sample, tokenizer, sampling=SamplingParams(max_new_tokens=4)) as server:
                async def agent(question):
                    session = server.open_session()
                    messages = [{"role": "user", "content": question}]
                    async with client(session) as oai:
                        for _ in range(2):
                            r = await oai.chat.completions.create(model="policy", messages=messages)
                            messages += [r.choices[0].message.model_dump(exclude_none=True),
                                         {"role": "user", "content": "More."}]
                    return await session.close()

                return await asyncio.gather(agent("What is 1 + 2?"), agent("Compute 3 times 4.")), engine.calls

    (t1, t2), calls = asyncio.run(body())
    for traj, question in ((t1, "What is 1 + 2?"), (t2, "Compute 3 times 4.")):
        assert list(traj.prompt_ids) == enc(tokenizer, chatml(("user", question)))
        assert traj.turns == 2 and traj.info["branches"] == 1 and traj.info["calls"] == 2
        full = [*traj.prompt_ids, *traj.response_ids]
        mine = [c for c in calls if c[0] == full[:len(c[0])]]  # the engine calls this episode is made of
        assert len(mine) == 2 and [*mine[-1][0], *mine[-1][2].token_ids] == full
    assert t1.info["session"] != t2.info["session"]


# ------------------------------------------------------------------------------------------ setup errors


def test_a_tokenizer_without_a_chat_template_is_one_clear_line(tokenizer, scripted):
    tokenizer.hf.chat_template = None
    with pytest.raises(ConfigError) as err:
        CaptureServer(scripted([]), tokenizer)
    assert "chat template" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ /v1/completions


def test_completions_continue_by_text_and_by_token_ids_without_re_encoding(tokenizer, scripted):
    im_end = ids(tokenizer, "<|im_end|>")
    r1, r2, r3 = enc(tokenizer, " 3 + 4"), [*enc(tokenizer, " = 7"), im_end], enc(tokenizer, " 8")
    sampler = scripted([r1, r2, r3])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            async with client(session) as oai:
                first = await oai.completions.create(model="policy", prompt="What is", max_tokens=8, logprobs=1)
                text = "What is" + first.choices[0].text + " then"
                second = await oai.completions.create(model="policy", prompt=text, max_tokens=8)
                traj = session.trajectory()
                # an agent that keeps token ids: the recorded tokens plus its own, sent back as ids
                again = [*traj.prompt_ids, *traj.response_ids, *enc(tokenizer, " so")]
                third = await oai.completions.create(model="policy", prompt=again, max_tokens=8)
            return first, second, third, await session.close()

    first, second, third, traj = asyncio.run(body())
    assert first.choices[0].text == " 3 + 4" and first.choices[0].finish_reason == "length"
    assert first.choices[0].logprobs.token_logprobs == [-0.5 - i / 100 for i in range(len(r1))]
    assert second.choices[0].text == " = 7" and second.choices[0].finish_reason == "stop"
    assert third.object == "text_completion" and traj.info["branches"] == 1 and traj.turns == 3
    assert list(traj.prompt_ids) == tokenizer.hf.encode("What is")
    assert [list(s.token_ids) for s in traj.segments] == [
        r1, enc(tokenizer, " then"), r2, enc(tokenizer, " so"), r3]
    assert [s.sampled for s in traj.segments] == [True, False, True, False, True]
    for prompt, _, _ in sampler.calls[1:]:  # every prompt is the recorded tokens so far, as they were
        assert prompt == [*traj.prompt_ids, *traj.response_ids][:len(prompt)]
