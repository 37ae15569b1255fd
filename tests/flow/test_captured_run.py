"""A captured agent trained by the real runtime: the ``agent`` section, the local chat checkpoint, two steps.

The agent is written with the real ``openai`` client and knows nothing of
asyncflow: three chat calls with a tool message between them. Every call is
a turn request through the rollout stage's dispatch (the recording engine
sees it); each written row is checked against what the engine sampled: the
trained sequence (the row's ``prompt_ids`` + ``response_ids``) is the last
call's prompt plus its tokens, every sampled run of the loss mask is exactly
an engine result, and the tool message's tokens are mask 0. A run whose every
agent fails ends, once the data runs out, with the reason instead of waiting.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.capture.testing import (  # noqa: E402
    masked_runs, recording, sampled_after, tool_message_hits, write_agent_package,
)
from asyncflow_core.config import load_config, resolve  # noqa: E402
from asyncflow_core.flow import run_report  # noqa: E402
from asyncflow_core.flow.runtime import FlowRuntime  # noqa: E402
from asyncflow_core.flow.trajectory_writer import TrajectoryWriter  # noqa: E402
from asyncflow_plugins.hf.rollout import TorchRolloutEngine  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "chat_arithmetic.jsonl"

#: a user's agent module: the OpenAI SDK only
AGENT = textwrap.dedent('''
    from openai import AsyncOpenAI

    TOOLS = [{"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}]

    async def agent(record, *, base_url, api_key, calls=3, tool_text="tool says 7"):
        messages = [{"role": "system", "content": "You may call add."}, *map(dict, record["messages"])]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for k in range(calls):
                out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                messages.append(out.choices[0].message.model_dump(exclude_none=True))
                if k < calls - 1:
                    messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": tool_text})
''')


Recording = recording(TorchRolloutEngine)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_local_chat_checkpoint(tmp_path_factory.mktemp("captured") / "ckpt")


@pytest.fixture
def agent_module(tmp_path, monkeypatch) -> str:
    return write_agent_package(tmp_path, "pkg_agents", AGENT, monkeypatch)


def _runtime(checkpoint: Path, tmp_path: Path, entry: str) -> FlowRuntime:
    pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")
    config = {
        "name": "captured-smoke", "seed": 0,
        "model": {"path": str(checkpoint)},
        "data": {"name": "jsonl", "options": {"path": str(DATA), "answer_key": "answer"}, "prompts_per_step": 2},
        "rollout": {"name": "torch", "options": {"device": "cpu", "max_batch": 16}, "n": 2, "max_new_tokens": 6},
        "trainer": {"name": "fsdp", "total_steps": 2, "checkpoint_every": 0, "export_final": False,
                    "options": {"world_size": 1, "device": "cpu", "mixed_precision": "float32", "lr": 1e-3,
                                "cpu_threads_per_rank": 1}},
        "algorithm": {"name": "grpo", "options": {"group_size": 2}},
        "reward": {"name": "exact_match"},
        "async": {"mode": "one_step"},
        "agent": {"entry": entry, "options": {"calls": 3}, "timeout_s": 60, "max_calls": 5},
    }
    resolved = resolve(load_config(data=config))
    resolved = resolved.with_factory("rollout", Recording)
    return FlowRuntime(resolved, run_dir=tmp_path / "run", write_png=False)


def test_a_captured_openai_agent_trains_for_two_steps_on_exactly_the_sampled_tokens(checkpoint, agent_module,
                                                                                  tmp_path, monkeypatch):
    written: list[tuple[list, dict]] = []
    orig = TrajectoryWriter._episode_columns

    def spy(self, items):
        out = orig(self, items)
        written.append(([q.row for q, _ in items], {k: v for k, v in out[0].items()}))
        return out

    monkeypatch.setattr(TrajectoryWriter, "_episode_columns", spy)
    trained: list = []  # each step's batch, as the trainer got it
    figures = run_report.episode_figures

    def step_spy(batch):
        trained.append(batch)
        return figures(batch)

    monkeypatch.setattr(run_report, "episode_figures", step_spy)
    Recording.requests, Recording.results = [], []
    runtime = _runtime(checkpoint, tmp_path, agent_module)
    asyncio.run(runtime.run())
    summary = runtime.summary
    assert summary["stop_reason"] == "done" and summary["steps"] == 2, summary

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    tool_ids = hf.encode("<|im_start|>tool\ntool says 7<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    results = {r.request_id: r for r in Recording.results}
    sampled = {prefix: [tokens for tokens, _ in got]  # the prompt a request was sampled after -> what it returned
               for prefix, got in sampled_after((q, results.get(q.request_id)) for q in Recording.requests).items()}

    records = {}  # the agent's first prompt -> the dataset messages it came from
    for line in DATA.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        ids = hf.apply_chat_template([{"role": "system", "content": "You may call add."}, *msgs],
                                     add_generation_prompt=True, tokenize=True)
        records[tuple(ids if isinstance(ids, list) else ids["input_ids"])] = msgs
    rows = 0
    seqs = set()
    for row_ids, cols in written:
        assert C.PROMPT_IDS in cols  # the agent's own first prompt replaced the dataset's rendering
        for i, _row in enumerate(row_ids):
            prompt, resp = cols[C.PROMPT_IDS][i].tolist(), cols[C.RESPONSE_IDS][i].tolist()
            mask, turns = cols[C.LOSS_MASK][i].tolist(), int(cols[C.EPISODE_TURNS][i])
            if not resp:
                continue  # a placeholder (a failed row): none expected, checked below
            rows += 1
            assert turns == 3
            full = prompt + resp
            seqs.add((tuple(full), tuple(mask)))
            # every maximal run of mask 1 is one engine result, sampled after exactly the tokens before it
            calls = 0
            for k, end, before in masked_runs(prompt, resp, mask):
                assert resp[k:end] in sampled.get(before, []), f"row {_row}: tokens {k}:{end} are not what the " \
                                                              "engine sampled after that prefix"
                calls += 1
            assert calls == 3
            # the tool message's tokens are all mask 0
            hits = tool_message_hits(resp, tool_ids)
            assert len(hits) == 2, f"row {_row}: the tool message should appear twice"
            for j in hits:
                assert not any(mask[j:j + len(tool_ids)])
            # the row's prompt is the agent's first call through the chat template (its own system message)
            assert tuple(prompt) in records
    assert rows >= 2 * 2 * 2  # 2 steps x 2 prompts x n=2 trained (the rollout may run ahead of the trainer)
    # the trainer got those rows: the agent's prompt (not the dataset's rendering), the response and its mask
    assert len(trained) == 2
    for batch in trained:
        assert batch.num_rows == 4
        for i in range(batch.num_rows):
            prompt = batch[C.PROMPT_IDS][i].tolist()
            assert tuple(prompt) in records
            full = tuple(prompt + batch[C.RESPONSE_IDS][i].tolist())
            assert (full, tuple(int(m) for m in batch[C.LOSS_MASK][i].tolist())) in seqs
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["episode/turns"] == 3.0 and 0 < r["episode/masked_frac"] < 1


WATCHDOG_S = 240  #: a hang guard, not a timing: the run stops in seconds

FAILING = textwrap.dedent('''
    async def agent(record, *, base_url, api_key, **options):
        raise RuntimeError("the agent's own bug")
''')


def test_a_run_whose_every_agent_fails_stops_with_the_reason_once_the_data_runs_out(checkpoint, tmp_path,
                                                                                   monkeypatch):
    """Every row fails and is dropped; the one-epoch dataset runs out: the run ends saying so (it used to wait
    forever: the trainer held the leases of the dropped rows, so the store never reported the stream's end)."""
    (tmp_path / "pkg_failing").mkdir()
    (tmp_path / "pkg_failing" / "__init__.py").write_text("")
    (tmp_path / "pkg_failing" / "bad.py").write_text(FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = _runtime(checkpoint, tmp_path, "pkg_failing.bad:agent")

    async def bounded():  # a regression fails with the watchdog's reason (RunStopped) instead of hanging the suite
        async def watchdog():
            await asyncio.sleep(WATCHDOG_S)
            runtime.ctx.halt(f"watchdog: the run did not stop by itself within {WATCHDOG_S}s")

        dog = asyncio.ensure_future(watchdog())
        try:
            await runtime.run()
        finally:
            dog.cancel()

    asyncio.run(bounded())
    summary = runtime.summary
    assert summary["steps"] == 0
    assert summary["stop_reason"] == "the prompt stream ended before step 0 could gather 2 prompt groups", summary
    rows = len(DATA.read_text().splitlines())
    assert summary["ledger"]["dropped_failed"] == summary["ledger"]["admitted"] == rows
    assert summary["counters"]["episodes_failed"] == 2 * rows  # n = 2 per prompt, each failed once
