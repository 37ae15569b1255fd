"""The capture endpoint's HTTP surface: every refused request is a 4xx with one clear line; the server goes away.

Bad requests are sent raw (aiohttp's client) where the ``openai`` client
would refuse to send them, and through the ``openai`` client otherwise, to
show what an agent sees.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from asyncflow_core.capture import CaptureServer
from asyncflow_core.types import SamplingParams

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is 1 + 2?"}]


def one_line(msg: str) -> None:
    assert msg and "\n" not in msg and "Traceback" not in msg, msg


def end(tokenizer, text="3"):
    return [*tokenizer.hf.encode(text, add_special_tokens=False), tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]


async def post(url, body, key, *, raw=None):
    async with aiohttp.ClientSession() as http:
        kwargs = {"data": raw} if raw is not None else {"json": body}
        async with http.post(url, headers={"Authorization": f"Bearer {key}"}, **kwargs) as resp:
            return resp.status, await resp.json()


BAD = [  # (body change, status, words the message must hold)
    ({"messages": None}, 400, "'messages' must be a non-empty list"),
    ({"messages": []}, 400, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0] has the role 'bot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "text only"),
    ({"model": "gpt-4o"}, 404, "the model 'gpt-4o' is not served here; use model='policy'"),
    ({"n": 2}, 400, "n=2 is not supported"),
    ({"stream": "yes"}, 400, "stream must be true or false"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream=true"),
    ({"top_logprobs": 3}, 400, "top_logprobs is not supported"),
    ({"tool_choice": "required"}, 400, "tool_choice='required' is not supported"),
    ({"max_tokens": 0}, 400, "max_tokens must be a whole number >= 1"),
    ({"temperature": "hot"}, 400, "temperature must be a number"),
    ({"stop": ["What is"]}, 400, "stop 'What is' is"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format other than text"),
    ({"tools": [{"name": "add"}]}, 400, "'tools' must be a list of {type: 'function'"),
]


def test_each_bad_request_is_a_4xx_with_one_clear_line(tokenizer, scripted):
    sampler = scripted([end(tokenizer)])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            url = f"{session.base_url}/chat/completions"
            good = {"model": "policy", "messages": USER}
            got = [await post(url, {**good, **change}, session.api_key) for change, _, _ in BAD]
            got.append(await post(url, {"model": "policy"}, session.api_key))
            got.append(await post(url, None, session.api_key, raw=b"{not json"))
            got.append(await post(url, good, "wrong-key"))
            got.append(await post(f"{server.url}/s/nope/v1/chat/completions", good, session.api_key))
            got.append(await post(f"{server.url}/v1/chat/completions", good, session.api_key))
            got.append(await post(f"{server.url}/s/{session.id}/reward", {"reward": "high"}, session.api_key))
            done = f"{session.base_url}/completions"
            got.append(await post(done, {"prompt": ["a", "b"]}, session.api_key))
            got.append(await post(done, {"prompt": "a", "echo": True}, session.api_key))
            got.append(await post(done, {"prompt": "a", "logprobs": 5}, session.api_key))
            got.append(await post(done, {"max_tokens": 3}, session.api_key))
            ok = await post(url, good, session.api_key)  # after all that, the session still works
            return got, ok, await session.close()

    got, ok, traj = asyncio.run(body())
    expected = [(s, w) for _, s, w in BAD] + [
        (400, "missing 'messages'"), (400, "not valid JSON"), (401, "missing or wrong API key"),
        (404, "unknown session 'nope'"), (404, "no route POST /v1/chat/completions"),
        (400, "'reward' must be a number"), (400, "one prompt per call"), (400, "echo is not supported"),
        (400, "logprobs=5 is not supported"), (400, "missing 'prompt'")]
    for (status, body), (want_status, words) in zip(got, expected, strict=True):
        err = body["error"]
        one_line(err["message"])
        assert (status, words in err["message"]) == (want_status, True), (status, err)
        assert set(err) == {"message", "type", "param", "code"}
    assert ok[0] == 200 and ok[1]["choices"][0]["message"]["content"] == "3"
    # refused requests never reach the session: one call, one branch, no errors recorded
    assert len(sampler.calls) == 1 and traj.info["calls"] == 1 and traj.info["errors"] == []
    assert traj.info["branches"] == 1 and traj.turns == 1


def test_the_openai_client_sees_the_status_and_the_line(tokenizer, scripted):
    async def body():
        async with CaptureServer(scripted([]), tokenizer) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                with pytest.raises(openai.NotFoundError) as wrong_model:
                    await oai.chat.completions.create(model="gpt-4o", messages=USER)
                with pytest.raises(openai.BadRequestError) as many:
                    await oai.chat.completions.create(model="policy", messages=USER, n=3)
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key="nope", max_retries=0) as oai:
                with pytest.raises(openai.AuthenticationError):
                    await oai.chat.completions.create(model="policy", messages=USER)
            return wrong_model.value, many.value

    wrong_model, many = asyncio.run(body())
    assert wrong_model.status_code == 404 and "use model='policy'" in wrong_model.message
    assert many.status_code == 400 and "n=3 is not supported" in many.message


def test_an_engine_failure_is_a_500_line_and_records_nothing(tokenizer, scripted):
    sampler = scripted([RuntimeError("replica 2 lost its GPU\nstack..."), end(tokenizer)])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                with pytest.raises(openai.InternalServerError) as err:
                    await oai.chat.completions.create(model="policy", messages=USER)
                await oai.chat.completions.create(model="policy", messages=USER)
            return err.value, await session.close()

    err, traj = asyncio.run(body())
    assert err.status_code == 500 and "the engine failed: RuntimeError: replica 2 lost its GPU" in err.message
    one_line(err.message)
    assert traj.turns == 1 and traj.info["branches"] == 1 and traj.info["branch_reason"] == "first call"
    assert traj.info["errors"] == ["the engine failed: RuntimeError: replica 2 lost its GPU"]


def test_reward_models_max_tokens_and_a_closed_session(tokenizer, scripted):
    sampler = scripted([end(tokenizer)])

    async def body():
        async with CaptureServer(sampler, tokenizer, sampling=SamplingParams(max_new_tokens=5)) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                models = await oai.models.list()
                await oai.chat.completions.create(model="policy", messages=USER, max_tokens=4096)
            reward = await post(f"{server.url}/s/{session.id}/reward", {"reward": 1.5}, session.api_key)
            traj = await server.close_session(session)
            after = await post(f"{session.base_url}/chat/completions", {"messages": USER}, session.api_key)
            idle = server.open_session()
            empty = await idle.close()  # closed on its own: still known to the server, so 410
            gone = await post(f"{idle.base_url}/chat/completions", {"messages": USER}, idle.api_key)
            return [m.id for m in models.data], reward, traj, (after, empty, gone)

    models, reward, traj, (after, empty, gone) = asyncio.run(body())
    assert empty.status == "failed: the agent made no successful call" and empty.prompt_ids == ()
    assert gone[0] == 410 and "is closed" in gone[1]["error"]["message"]
    assert models == ["policy"] and reward == (200, {"session": traj.info["session"], "reward": 1.5})
    assert traj.reward == 1.5 and traj.info["max_tokens_clamped"] == 1
    assert sampler.calls[0][1].max_new_tokens == 5  # the run's budget caps the agent's max_tokens
    assert after[0] == 404 and "unknown session" in after[1]["error"]["message"]


def test_the_server_binds_loopback_only_and_its_port_is_free_after_stop(tokenizer, scripted):
    async def body():
        server = CaptureServer(scripted([]), tokenizer)
        async with server:
            port = server.port
            assert server.url == f"http://127.0.0.1:{port}"
            session = server.open_session()
            listening = await post(f"{session.base_url}/chat/completions", {"n": 2, "messages": USER}, server.api_key)
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(f"http://127.0.0.1:{port}/s/{session.id}/v1/chat/completions", {"messages": USER},
                       server.api_key)
        return port, listening

    port, listening = asyncio.run(body())
    assert listening[0] == 400
    with socket.socket() as sock:  # the port was released
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_tools_reach_the_chat_template(tokenizer, scripted):
    """A tool-aware template (tools listed in the system turn): the first prompt is its rendering with the tools."""
    tokenizer.hf.chat_template = (
        "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
        "<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    sampler = scripted([end(tokenizer)])

    async def body():
        async with CaptureServer(sampler, tokenizer) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as oai:
                await oai.chat.completions.create(model="policy", messages=USER, tools=tools)
            return await session.close()

    traj = asyncio.run(body())
    text = ("<|im_start|>system\n# Tools\nadd\n<|im_end|>\n"
            "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert list(traj.prompt_ids) == tokenizer.hf.encode(text, add_special_tokens=False)
