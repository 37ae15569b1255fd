"""Chat models from a local checkpoint: the checkpoint's tokenizer, chat templates, stop ids, and their bad inputs.

The checkpoint is real and built here, without a hub
(:func:`asyncflow_plugins.hf.testing.build_local_chat_checkpoint`): a random
Qwen2, a BPE tokenizer trained on the fly, a ChatML template and a
``generation_config.json`` whose EOS is ``<|im_end|>``. Everything loads it
by path, as it would a downloaded model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from asyncflow_core.capture.testing import recording  # noqa: E402
from asyncflow_core.config import load_config, resolve  # noqa: E402
from asyncflow_core.config.models import ModelConfig  # noqa: E402
from asyncflow_core.errors import ConfigError  # noqa: E402
from asyncflow_core.flow.runtime import FlowRuntime  # noqa: E402
from asyncflow_core.flow.tokenizer import encode_record, make_tokenizer, stop_token_ids  # noqa: E402
from asyncflow_core.types import FinishReason, PromptRecord  # noqa: E402
from asyncflow_plugins.datasets import JsonlConfig, JsonlDataset  # noqa: E402
from asyncflow_plugins.hf.rollout import TorchRolloutEngine  # noqa: E402
from asyncflow_plugins.hf.testing import build_local_chat_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "chat_arithmetic.jsonl"
SYSTEM = "Answer with the number only."


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return build_local_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


def _hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _template_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def _one_line(msg: str) -> None:
    assert "\n" not in msg and "Traceback" not in msg, msg


# ------------------------------------------------------------------------------------------ the checkpoint


def test_the_checkpoint_loads_by_path_like_a_downloaded_one(checkpoint):
    assert json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    tok = _hf(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [tok.convert_tokens_to_ids(s) for s in specials] == [0, 1, 2]
    for i, special in enumerate(specials):
        assert tok.encode(f"a{special}b")[1:-1] == [i], special  # one token, never split by the BPE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "What is 3 + 4? #### 7"
    assert tok.decode(tok.encode(text)) == text
    # the same arguments give the same files (tests and examples can rebuild it anywhere)
    again = build_local_chat_checkpoint(checkpoint.parent / "again")
    for name in ("tokenizer.json", "config.json", "generation_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_a_messages_record_renders_to_exactly_the_chat_template_ids(checkpoint):
    dataset = JsonlDataset(JsonlConfig(path=str(DATA), answer_key="answer"))
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    hf = _hf(checkpoint)
    plain = make_tokenizer(ModelConfig(path=str(checkpoint)))
    with_system = make_tokenizer(ModelConfig(path=str(checkpoint), system_prompt=SYSTEM))
    for i, row in enumerate(rows):
        rec = dataset[i]
        assert rec.prompt == row["messages"][-1]["content"] and rec.metadata["answer"] == row["answer"]
        assert list(encode_record(plain, rec)) == _template_ids(hf, row["messages"])
        own_system = row["messages"][0]["role"] == "system"
        expected = row["messages"] if own_system else [{"role": "system", "content": SYSTEM}, *row["messages"]]
        assert list(encode_record(with_system, rec)) == _template_ids(hf, expected)
    assert any(r["messages"][0]["role"] == "system" for r in rows)  # both branches were exercised
    # a prompt record is encoded as it is, by the checkpoint's tokenizer
    rec = PromptRecord(index=0, prompt="What is 1 + 2?")
    assert list(encode_record(plain, rec)) == hf.encode("What is 1 + 2?")


def test_stop_ids_come_from_the_generation_config(checkpoint, tmp_path):
    hf = _hf(checkpoint)
    im_end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    model = ModelConfig(path=str(checkpoint))
    assert stop_token_ids(model, make_tokenizer(model)) == (im_end, eot)
    # an int eos_token_id, and a checkpoint without a generation config: the tokenizer's EOS alone
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    gen = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eot}))
    model = ModelConfig(path=str(other))
    assert stop_token_ids(model, make_tokenizer(model)) == (im_end, eot)
    (other / "generation_config.json").unlink()
    assert stop_token_ids(model, make_tokenizer(model)) == (im_end,)
    # completions are decoded for rewards without the special tokens that ended them
    tok = make_tokenizer(ModelConfig(path=str(checkpoint)))
    assert tok.decode([*hf.encode("7"), im_end]) == "7"


# ------------------------------------------------------------------------------------------ bad input


def test_a_checkpoint_without_a_tokenizer_is_one_clear_line(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, bare / name)
    with pytest.raises(ConfigError) as err:
        make_tokenizer(ModelConfig(path=str(bare)))
    msg = str(err.value)
    _one_line(msg)
    assert str(bare) in msg and "has no tokenizer" in msg and "tokenizer.save_pretrained" in msg


def _chat_jsonl(tmp_path: Path, messages) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt_id": 0, "answer": "1", "messages": messages}) + "\n")
    return path


def test_messages_with_an_unknown_role_are_refused_when_the_file_is_read(tmp_path):
    path = _chat_jsonl(tmp_path, [{"role": "user", "content": "hi"}, {"role": "bot", "content": "1"}])
    with pytest.raises(ConfigError) as err:
        JsonlDataset(JsonlConfig(path=str(path)))
    msg = str(err.value)
    _one_line(msg)
    assert f"{path}:1" in msg and "messages[1]" in msg and "unknown role 'bot'" in msg
    assert "system, user, assistant, tool" in msg


def test_messages_without_a_chat_template_are_one_clear_line(checkpoint, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(checkpoint, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    rec = JsonlDataset(JsonlConfig(path=str(DATA)))[0]
    with pytest.raises(ConfigError) as err:
        encode_record(make_tokenizer(ModelConfig(path=str(plain))), rec)
    msg = str(err.value)
    _one_line(msg)
    assert "dataset record 0" in msg and "no chat template" in msg and str(plain) in msg
    # and the character tokenizer (no model.path) cannot render a chat at all
    with pytest.raises(ConfigError, match="need a checkpoint's tokenizer and chat template; set model.path"):
        encode_record(make_tokenizer(ModelConfig()), rec)


def test_a_prompt_longer_than_the_context_is_one_clear_line(checkpoint):
    tok = make_tokenizer(ModelConfig(path=str(checkpoint)))
    positions = transformers.AutoConfig.from_pretrained(checkpoint).max_position_embeddings
    words = " ".join(["apples"] * positions)
    assert len(tok.encode(words)) >= positions
    with pytest.raises(ConfigError) as err:
        encode_record(tok, PromptRecord(index=5, prompt=words))
    msg = str(err.value)
    _one_line(msg)
    assert "dataset record 5" in msg and f"context is {positions} positions" in msg and "shorten the prompt" in msg
    fits = " ".join(["apples"] * 8)
    assert encode_record(tok, PromptRecord(index=6, prompt=fits)) == tuple(tok.encode(fits))


def test_system_prompt_without_a_checkpoint_is_refused():
    with pytest.raises(ValueError, match="model.system_prompt is for chat records"):
        ModelConfig(system_prompt="be brief")


# ------------------------------------------------------------------------------------------ end to end


#: the torch engine, keeping every request (its prompt ids and stop ids) and every result
Recording = recording(TorchRolloutEngine)


def _chat_run(checkpoint: Path, tmp_path: Path, *overrides: str):
    pytest.importorskip("asyncflow_fsdp", reason="the asyncflow-fsdp adapter is not installed (make installs it)")

    config = {
        "name": "chat-smoke", "seed": 0,
        "model": {"path": str(checkpoint), "system_prompt": SYSTEM},
        "data": {"name": "jsonl", "options": {"path": str(DATA), "answer_key": "answer"}, "prompts_per_step": 2},
        "rollout": {"name": "torch", "options": {"device": "cpu", "max_batch": 16}, "n": 2, "max_new_tokens": 6},
        "trainer": {"name": "fsdp", "total_steps": 3, "checkpoint_every": 0, "export_final": False,
                    "options": {"world_size": 1, "device": "cpu", "mixed_precision": "float32", "lr": 1e-3,
                                "cpu_threads_per_rank": 1}},
        "algorithm": {"name": "grpo", "options": {"group_size": 2}},
        "reward": {"name": "exact_match"},
        "async": {"mode": "one_step"},
    }
    resolved = resolve(load_config(data=config, overrides=list(overrides)))
    resolved = resolved.with_factory("rollout", Recording)
    return FlowRuntime(resolved, run_dir=tmp_path / "run", write_png=False)


def test_a_chat_run_on_the_local_checkpoint_trains_on_template_ids(checkpoint, tmp_path):
    Recording.requests, Recording.results = [], []
    runtime = _chat_run(checkpoint, tmp_path)
    asyncio.run(runtime.run())
    summary = runtime.summary
    assert summary["stop_reason"] == "done" and summary["steps"] == 3, summary

    hf = _hf(checkpoint)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rendered = set()
    for row in rows:
        chat = row["messages"] if row["messages"][0]["role"] == "system" else [
            {"role": "system", "content": SYSTEM}, *row["messages"]]
        rendered.add(tuple(_template_ids(hf, chat)))
    stops = (hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>"))
    assert Recording.requests
    for req in Recording.requests:  # the engine got the chat template's ids, and the checkpoint's stop ids
        assert tuple(req.prompt_token_ids) in rendered
        assert tuple(req.sampling.stop_token_ids) == stops
    for res in Recording.results:  # what ended each completion: a stop id or the budget
        if res.finish_reason is FinishReason.STOP:
            assert res.token_ids[-1] in stops and not set(res.token_ids[:-1]) & set(stops)
        elif res.finish_reason is FinishReason.LENGTH:
            assert len(res.token_ids) == 6
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_a_chat_run_stops_on_a_prompt_longer_than_the_context_with_one_line(checkpoint, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"messages": [{"role": "user", "content": " ".join(["apples"] * 300)}],
                                "answer": "1"}) + "\n")
    runtime = _chat_run(checkpoint, tmp_path, f"data.options.path={long}", "data.prompts_per_step=1",
                        "trainer.total_steps=1")
    with pytest.raises(ConfigError) as err:
        asyncio.run(runtime.run())
    msg = str(err.value)
    _one_line(msg)
    assert "dataset record 0" in msg and "context is 256 positions" in msg


def test_a_row_with_both_a_prompt_and_messages_is_refused(tmp_path):
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1?"}]}) + "\n")
    with pytest.raises(ConfigError) as err:
        JsonlDataset(JsonlConfig(path=str(path)))
    msg = str(err.value)
    _one_line(msg)
    assert f"{path}:1" in msg and "both a prompt and 'messages'; keep one" in msg
