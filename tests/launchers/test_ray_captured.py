"""A captured OpenAI-SDK agent under ``launcher.name=ray``: the capture endpoint in the driver, the engines in actors.

The flow runtime, the rollout stage's episodes, the capture server and the
agents run in the driver (as under ``local``); each call the agent makes is
the episode's turn request, dispatched to a rollout replica that is a Ray
actor in another process. One loopback-only Ray (``conftest.py``,
``init_local_ray``). Two steps: every trained row is checked against what the
replica actors returned (seen at the driver's proxy), the tool message is
mask 0, and the endpoint and Ray listened on loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray launcher needs Ray: pip install 'asyncflow[ray]'")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")
pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.capture.testing import (  # noqa: E402
    masked_runs, sampled_after, tool_message_hits, write_agent_package,
)
from asyncflow_core.config.loader import load_config, resolve  # noqa: E402
from asyncflow_core.flow.trajectory_writer import TrajectoryWriter  # noqa: E402
from asyncflow_core.launchers.ray import remote as R  # noqa: E402
from asyncflow_core.launchers.ray.launcher import RayLauncher  # noqa: E402
from asyncflow_core.store.deployments.ray_store import ray_listening_addresses  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "chat_arithmetic.jsonl"
TOOL_TEXT = "tool says 7"

#: a user's agent module: the OpenAI SDK only (it also notes where it ran and which URL it was given)
AGENT = textwrap.dedent('''
    import json, os
    from openai import AsyncOpenAI

    async def agent(record, *, base_url, api_key, log, calls=2, tool_text="tool says 7"):
        messages = [{"role": "system", "content": "You may call add."}, *map(dict, record["messages"])]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for k in range(calls):
                out = await client.chat.completions.create(model="policy", messages=messages)
                messages.append(out.choices[0].message.model_dump(exclude_none=True))
                if k < calls - 1:
                    messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": tool_text})
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "base_url": base_url}) + "\\n")
''')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_local_chat_checkpoint(tmp_path_factory.mktemp("ray-captured") / "ckpt")


@pytest.fixture
def agent_module(tmp_path, monkeypatch) -> str:
    return write_agent_package(tmp_path, "pkg_ray_agents", AGENT, monkeypatch)


@pytest.mark.slow
def test_a_captured_agent_trains_under_ray_on_what_the_replica_actors_sampled(checkpoint, agent_module, tmp_path,
                                                                             monkeypatch):
    seen: list = []  # (request, result) pairs as the driver's proxies got them from the replica actors
    generate = R.RemoteRolloutEngine.generate

    async def spy(self, requests):
        requests = list(requests)
        by_id = {q.request_id: q for q in requests}
        async for res in generate(self, requests):
            seen.append((by_id[res.request_id], res))
            yield res

    monkeypatch.setattr(R.RemoteRolloutEngine, "generate", spy)
    written: list[dict] = []
    orig = TrajectoryWriter._episode_columns

    def columns(self, items):
        out = orig(self, items)
        written.append({k: v for k, v in out[0].items()})
        return out

    monkeypatch.setattr(TrajectoryWriter, "_episode_columns", columns)
    log = tmp_path / "agents.jsonl"
    config = {
        "name": "captured-ray", "seed": 0,
        "model": {"path": str(checkpoint)},
        "data": {"name": "jsonl", "options": {"path": str(DATA), "answer_key": "answer"}, "prompts_per_step": 2},
        "rollout": {"name": "torch", "options": {"device": "cpu", "max_batch": 16}, "n": 2, "max_new_tokens": 6},
        "trainer": {"name": "fsdp", "total_steps": 2, "checkpoint_every": 0, "export_final": False,
                    "options": {"world_size": 1, "device": "cpu", "mixed_precision": "float32", "lr": 1e-3,
                                "cpu_threads_per_rank": 1}},
        "algorithm": {"name": "grpo", "options": {"group_size": 2}},
        "reward": {"name": "exact_match"},
        "async": {"mode": "one_step"},
        "agent": {"entry": agent_module, "options": {"calls": 2, "log": str(log), "tool_text": TOOL_TEXT},
                  "timeout_s": 120, "max_calls": 4},
        "launcher": {"name": "ray", "options": {"rollout_cpus": 0.5, "trainer_cpus": 0.5, "reward_cpus": 0.25}},
    }
    resolved = resolve(load_config(data=config))
    launcher = RayLauncher(resolved.components["launcher"].options)
    before = {(ip, port) for ip, port, _ in ray_listening_addresses()}
    sockets: list = []

    async def main():
        async def watch():  # the sockets open while the run goes (the capture server starts with the first episode)
            while launcher.runtime is None or launcher.runtime.ctx is None or not seen:
                await asyncio.sleep(0.05)
            sockets.extend(ray_listening_addresses())

        side = asyncio.ensure_future(watch())
        try:
            return await launcher.run(resolved, run_dir=tmp_path / "run")
        finally:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
            await launcher.shutdown()

    summary = asyncio.run(main())
    assert summary["steps"] == 2 and summary["stop_reason"] == "done", summary

    # the engines ran in actor processes, the agents (and the endpoint they called) in this driver, on loopback
    pids = {p.pid for p in launcher.roles.proxies if hasattr(p, "pid")}
    assert pids and os.getpid() not in pids
    agents = [json.loads(line) for line in log.read_text().splitlines()]
    assert agents and {a["pid"] for a in agents} == {os.getpid()}
    assert all(a["base_url"].startswith("http://127.0.0.1:") for a in agents)
    assert sockets and all(_loopback(ip) for ip, _, _ in sockets), [a for a in sockets if (a[0], a[1]) not in before]
    port = int(agents[0]["base_url"].split(":")[2].split("/")[0])
    assert ("127.0.0.1", port, os.getpid()) in sockets  # the capture server: in the driver, on loopback

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    tool_ids = hf.encode(f"<|im_start|>tool\n{TOOL_TEXT}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sampled = {prefix: [tokens for tokens, _ in got] for prefix, got in sampled_after(seen).items()}
    rows = 0
    for cols in written:
        for i in range(len(cols[C.PROMPT_IDS])):
            prompt, resp = cols[C.PROMPT_IDS][i].tolist(), cols[C.RESPONSE_IDS][i].tolist()
            mask = cols[C.LOSS_MASK][i].tolist()
            assert resp and int(cols[C.EPISODE_TURNS][i]) == 2
            rows += 1
            runs = 0
            for k, end, before in masked_runs(prompt, resp, mask):  # each: a replica actor's result after `before`
                assert resp[k:end] in sampled.get(before, []), \
                    f"tokens {k}:{end} are not what a replica actor sampled after that prefix"
                runs += 1
            assert runs == 2
            hits = tool_message_hits(resp, tool_ids)
            assert len(hits) == 1 and not any(mask[hits[0]:hits[0] + len(tool_ids)])
    assert rows >= 2 * 2 * 2  # 2 steps x 2 prompts x n=2
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2] and all(r["episode/turns"] == 2.0 for r in steps)
    assert all(int(lag) <= 1 for r in steps for lag in r["staleness_histogram"])  # one_step: k = 1


def _loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip).is_loopback
