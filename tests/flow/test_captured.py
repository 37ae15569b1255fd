"""Captured agent episodes through the rollout stage: the real ``openai`` client, the local chat checkpoint's
tokenizer, a fake token-level engine (aborts, resumes, moving versions) and a real store.

Each agent call is a turn request in the stage's dispatch; the rows are read
back from the store and compared with what the engine returned.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from openai import AsyncOpenAI  # noqa: E402

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.capture import CaptureServer  # noqa: E402
from asyncflow_core.config import load_config, resolve  # noqa: E402
from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.flow.captured import AgentEpisodes, AgentSettings  # noqa: E402
from asyncflow_core.flow.episode import build_episodes  # noqa: E402
from asyncflow_core.flow.tokenizer import make_tokenizer  # noqa: E402
from asyncflow_core.types import PromptRecord, SamplingParams  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402
from tests.flow.test_episode import FakeEngine, _rows, _run, failed  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(ModelConfig(path=str(build_local_chat_checkpoint(tmp_path_factory.mktemp("cap") / "c"))))


def _im_end(tok) -> int:
    return tok.hf.convert_tokens_to_ids("<|im_end|>")


def _engines(tok, n: int = 2):
    # printable tokens only (ids 30..199 of the checkpoint's byte-level vocabulary), and <|im_end|> as the stop
    return [FakeEngine(seed=s, vocab=200, low=30, stop=_im_end(tok)) for s in range(n)]


def _episodes(tok, agent, *, score=None, **kw) -> AgentEpisodes:
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=(_im_end(tok),))
    opts = {"timeout_s": 30.0, "max_calls": 8}
    opts.update(kw)
    return AgentEpisodes(AgentSettings(agent=agent, server=CaptureServer(None, tok, sampling=sampling),
                                       entry="tests:agent", score=score, **opts))


def recs(n: int, **meta):
    return [PromptRecord(i, f"q{i}", metadata={"calls": 3, **meta}) for i in range(n)]


async def tool_agent(record, *, base_url, api_key, **_):
    """Three calls with a tool message between them; posts a reward when the record asks it to."""
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": record["prompt"]}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for k in range(record["calls"]):
            if k:
                messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"tool output {k}"})
            out = await client.chat.completions.create(model="policy", messages=messages)
            messages.append(out.choices[0].message.model_dump(exclude_none=True))
        if "post" in record:
            import httpx

            async with httpx.AsyncClient() as http:
                got = await http.post(base_url.removesuffix("/v1") + "/reward", json={"reward": record["post"]},
                                      headers={"Authorization": f"Bearer {api_key}"})
                got.raise_for_status()
        if record.get("raise_after"):
            raise RuntimeError("the agent's own bug")
        if record.get("sleep_after"):
            await asyncio.sleep(record["sleep_after"])


async def _go(tok, records, episodes, **kw):
    try:
        return await _run(records, episodes, engines=kw.pop("engines", None) or _engines(tok), tok=tok, **kw)
    finally:
        await episodes.close()


def _check_rows(tok, rows, engines, ctx, *, turns=3):
    """Every row: mask 1 runs are exactly engine results for the prefix before them; the tool text is mask 0."""
    sampled: dict[tuple, list] = {}
    for e in engines:
        for rid, res in e.returned.items():
            if res.finish_reason.value in ("stop", "length"):
                sampled.setdefault(tuple(e.prompts[rid]), []).append(list(res.token_ids))
    checked = 0
    for row, r in rows.items():
        if row in failed(ctx):
            continue
        prompt, resp, mask = r[C.PROMPT_IDS], r[C.RESPONSE_IDS], r[C.LOSS_MASK]
        assert prompt[:3] == tok.hf.encode("<|im_start|>system\nUse", add_special_tokens=False)[:3]
        full = prompt + resp
        k = runs = 0
        while k < len(resp):
            if not mask[k]:
                k += 1
                continue
            end = k
            while end < len(resp) and mask[end]:
                end += 1
            assert resp[k:end] in sampled.get(tuple(full[:len(prompt) + k]), []), (row, k)
            runs += 1
            k = end
        assert runs == turns == r[C.EPISODE_TURNS]
        for j in range(1, turns):
            tool = tok.hf.encode(f"<|im_start|>tool\ntool output {j}<|im_end|>", add_special_tokens=False)
            at = [i for i in range(len(resp)) if resp[i:i + len(tool)] == tool]
            assert len(at) == 1 and not any(mask[at[0]:at[0] + len(tool)]), (row, j)
        checked += 1
    return checked


def test_each_agent_call_is_a_turn_of_the_stage_and_the_row_is_what_the_engine_sampled(tok):
    engines = _engines(tok)
    eps = _episodes(tok, tool_agent)
    batch, order, ctx, _, _ = asyncio.run(_go(tok, recs(6, post=0.5), eps, engines=engines))
    rows = _rows(batch, order)
    assert not failed(ctx) and sorted(rows) == list(range(6))
    assert _check_rows(tok, rows, engines, ctx) == 6
    assert all(r[C.REWARD] == 0.5 for r in rows.values())  # the agent's posted reward
    assert ctx.counters["episodes_done"] == 6 and ctx.counters["episode_turns"] == 18
    assert not eps.settings.server.sessions  # every session closed


def test_without_a_posted_reward_the_reward_plugin_scores_the_episode(tok):
    seen = []

    async def score(traj, record):
        seen.append((record.index, tok.decode(list(traj.response_ids))))
        return float(record.index)

    eps = _episodes(tok, tool_agent, score=score)
    batch, order, ctx, _, _ = asyncio.run(_go(tok, recs(3), eps))
    rows = _rows(batch, order)
    assert not failed(ctx)
    assert {row: r[C.REWARD] for row, r in rows.items()} == {0: 0.0, 1: 1.0, 2: 2.0}
    assert sorted(i for i, _ in seen) == [0, 1, 2] and all("tool output 2" in text for _, text in seen)


@pytest.mark.parametrize("meta, reason", [
    ({"raise_after": True}, "the agent tests:agent raised RuntimeError: the agent's own bug"),
    ({"sleep_after": 30}, "the agent tests:agent made no call and did not return within 0.5s (agent.timeout_s)"),
    ({"calls": 0}, "the agent made no successful call"),
])
def test_an_agent_failure_is_the_rows_recorded_reason_and_it_is_written_once(tok, meta, reason):
    eps = _episodes(tok, tool_agent, timeout_s=0.5, score=_zero)
    records = [*recs(2), *[PromptRecord(2 + i, f"bad{i}", metadata={"calls": 3, **meta}) for i in range(2)]]
    batch, order, ctx, at_write, _ = asyncio.run(_go(tok, records, eps, engines=None))
    rows = _rows(batch, order)
    assert sorted(at_write) == [0, 1, 2, 3]  # written once each (the harness refuses a second write)
    assert failed(ctx) == {2: f"rollout: {reason}", 3: f"rollout: {reason}"}
    assert rows[2][C.RESPONSE_IDS] == [] and rows[0][C.RESPONSE_IDS]
    assert ctx.counters["episodes_failed"] == 2


def test_a_call_past_max_calls_is_refused_and_the_episode_is_written_there_truncated(tok):
    refused = []

    async def greedy(record, *, base_url, api_key, **_):
        messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": record["prompt"]}]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for k in range(10):
                if k:
                    messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"tool output {k}"})
                try:
                    out = await client.chat.completions.create(model="policy", messages=messages)
                except Exception as exc:  # noqa: BLE001 - the refusal, as the agent sees it
                    refused.append((type(exc).__name__, getattr(exc, "status_code", None), str(exc)))
                    await asyncio.sleep(30)  # the episode is over: the agent is cancelled
                messages.append(out.choices[0].message.model_dump(exclude_none=True))

    async def score(traj, record):
        return 1.0

    engines = _engines(tok)
    eps = _episodes(tok, greedy, max_calls=3, score=score)
    batch, order, ctx, _, _ = asyncio.run(_go(tok, recs(2), eps, engines=engines))
    rows = _rows(batch, order)
    assert not failed(ctx)
    assert _check_rows(tok, rows, engines, ctx, turns=3) == 2
    assert all(r[C.TRUNCATED] and r[C.REWARD] == 1.0 for r in rows.values())
    assert [(name, status) for name, status, _ in refused] == [("BadRequestError", 400)] * 2
    assert "agent.max_calls" in refused[0][2]


@pytest.mark.parametrize("policy", ["requeue", "drop"])
def test_versions_moving_during_agent_episodes_never_give_a_row_outside_the_bound(tok, policy):
    k = 0
    engines = _engines(tok)
    eps = _episodes(tok, tool_agent, score=_zero)
    batch, order, ctx, at_write, _ = asyncio.run(_go(tok, recs(12, calls=4), eps, engines=engines, k=k,
                                                     policy=policy, bump_every=5, max_inflight=3))
    rows = _rows(batch, order)
    assert sorted(rows) == list(range(12))
    trained = 0
    for row, r in rows.items():
        if row in failed(ctx):
            assert r[C.RESPONSE_IDS] == []
            continue
        trained += 1
        sampled = [v for v, m in zip(r[C.RESPONSE_VERSIONS], r[C.LOSS_MASK]) if m]
        assert at_write[row] - min(sampled) <= k, row
    assert ctx.version >= 2  # versions really moved during the episodes
    restarted = ctx.counters["requeued_stale_episode"] + ctx.counters["dropped_stale_episode"]
    assert restarted > 0, ctx.counters
    if policy == "drop":
        assert ctx.counters["dropped_stale_episode"] == len(failed(ctx)) and trained == 12 - len(failed(ctx))
    else:
        assert not failed(ctx) and trained == 12
        assert _check_rows(tok, rows, engines, ctx, turns=4) == 12
    assert not eps.settings.server.sessions


async def _zero(traj, record):
    return 0.0


# ------------------------------------------------------------------------------------------ config


def _config(tmp_path, **extra):
    return {"name": "x", "reward": {"name": "exact_match"},
            "data": {"name": "jsonl", "options": {"path": str(tmp_path / "d.jsonl")}}, **extra}


def test_agent_and_environment_together_or_a_bad_entry_are_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    (tmp_path / "my_agents.py").write_text("def sync_agent(record, **kw):\n    pass\n\n"
                                           "async def agent(record, **kw):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        ({"agent": {"entry": "my_agents:agent"}, "environment": {"name": "calculator"}},
         "agent and environment are both set"),
        ({"agent": {"entry": "no_such_module_xyz:agent"}}, "module 'no_such_module_xyz' cannot be imported"),
        ({"agent": {"entry": "my_agents:missing"}}, "module 'my_agents' has no 'missing'"),
        ({"agent": {"entry": "my_agents.agent"}}, "is not `package.module:function`"),
        ({"agent": {"entry": "my_agents:sync_agent"}}, "is not an async function"),
    ]
    for extra, want in cases:
        with pytest.raises(ConfigError) as err:
            resolve(load_config(data=_config(tmp_path, **extra)))
        msg = str(err.value)
        assert want in msg and "\n" not in msg and "Traceback" not in msg, msg
    resolved = resolve(load_config(data=_config(tmp_path, agent={"entry": "my_agents:agent", "max_calls": 2})))
    assert resolved.config.agent.max_calls == 2 and resolved.config.agent.timeout_s == 120.0


def test_build_episodes_is_captured_with_an_agent_section_and_needs_a_chat_template(tmp_path, monkeypatch, tok):
    (tmp_path / "d.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    (tmp_path / "my_agents2.py").write_text("async def agent(record, **kw):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    resolved = resolve(load_config(data=_config(tmp_path, agent={"entry": "my_agents2:agent", "timeout_s": 5,
                                                                 "options": {"calls": 2}})))
    eps = build_episodes(resolved, tok, stop_ids=(_im_end(tok),))
    assert isinstance(eps, AgentEpisodes) and eps.multi_turn and C.REWARD in eps.columns
    s = eps.settings
    assert s.timeout_s == 5 and dict(s.options) == {"calls": 2} and s.score is not None
    assert s.server.sampling.stop_token_ids == (_im_end(tok),)
    from asyncflow_core.flow.tokenizer import CharTokenizer

    with pytest.raises(ConfigError, match="needs a Hugging Face tokenizer with a chat template"):
        build_episodes(resolved, CharTokenizer("abc"), stop_ids=(0,))


def test_closing_the_factory_mid_call_stops_the_agent_and_the_server_without_waiting_on_it(tok):
    """The run stops while an agent's call waits for its turn: the call is answered (refused), the agent
    cancelled, the session forgotten and the server stopped; nothing waits on the call that will never run."""
    seen = []

    async def agent(record, *, base_url, api_key, **_):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            try:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

    async def main():
        eps = _episodes(tok, agent)
        ep = eps.new(0, None, (1, 2), 0, None)
        progress = await ep.begin()
        assert progress.value == "continue" and ep.request(SamplingParams()).prompt_token_ids
        assert eps.settings.server.sessions and eps.live == {ep}
        await asyncio.wait_for(eps.close(), 60)  # a hang guard, not a timing assertion
        assert not eps.settings.server.sessions and not eps.live and ep.task is None
        assert eps.settings.server.port is None

    asyncio.run(main())
    assert seen == ["cancelled"]
