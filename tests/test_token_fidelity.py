"""Token fidelity across turns: the trained sequence is exactly the engine's tokens plus the rendered observations.

A hypothesis property over 10^4 episodes in total (many episodes per
example, so the budget stays near half a minute): random turn counts and
lengths, turns that end on a stop token or by length, observations as text,
chat messages (one or several, tool and user roles) or token ids, and four
tokenizers: the character tokenizer, and the local byte-level BPE checkpoint
with three chat templates (ChatML as shipped, a Qwen2.5-style ChatML that
groups consecutive tool messages into one user turn, and a Llama-3-style
template written into a tokenizer_config here). Each episode runs through
:class:`~asyncflow_core.flow.episode.MultiTurn` (reset, request, engine
result, step, render) and the :class:`TrajectoryWriter` into a store; the
rows read back are compared with what the fake engine returned and what the
environment showed:

- at every turn boundary, the request's prompt is exactly ``prompt_ids`` plus
  the response tokens before it (the engine saw the trained prefix);
- every sampled turn is in ``response_ids`` unchanged, with loss mask 1, its
  log-probs and versions; everything else has loss mask 0;
- with a chat template and turns that are the canonical tokens of a text
  (the text's tokens and the end-of-turn token), the whole trained sequence
  is a prefix of the template rendering the whole conversation at once, and
  what is left is only the template's trailer after the last turn: no
  separator dropped or doubled at any boundary (verl#6501), no re-encoding
  (TRL#5224).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_core import columns as C
from asyncflow_core.flow.episode import EpisodeSettings, MultiTurnEpisodes, Progress
from asyncflow_core.flow.render import Renderer
from asyncflow_core.flow.tokenizer import CharTokenizer, HFTokenizer
from asyncflow_core.flow.trajectory_writer import TrajectoryWriter
from asyncflow_core.interfaces.environment import Environment, EnvironmentFeatures, Observation, Step, ToolSpec
from asyncflow_core.types import FinishReason, GenerationResult, SamplingParams

pytest.importorskip("transformers")

EPISODES_PER_EXAMPLE = 100
EXAMPLES = 100  # 10^4 episodes

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :.=+"
WORDS = ("what", "is", "the", "answer", "tool", "result", "ok", "error", "compute", "apples", "left", "7", "42",
         "x", "=", "+", "Let's", "think", "step", "by", "sum", "calls")

#: Qwen2.5-style ChatML: tools in a system header, consecutive tool messages grouped in one user turn
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Llama-3 style: a BOS, role headers, <|eot_id|> after each turn and no separator after it; tools as ipython
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{%- for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

TOOLS = (ToolSpec("calc", "Evaluate an arithmetic expression.",
                  {"type": "object", "properties": {"expr": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, tuple]:
    """name -> (run tokenizer, stop ids, has a chat template)."""
    from transformers import AutoTokenizer

    from asyncflow_plugins.hf.testing import build_local_chat_checkpoint

    base = build_local_chat_checkpoint(tmp_path_factory.mktemp("chatml"))
    out: dict[str, tuple] = {"char": (CharTokenizer(ALPHABET), (ALPHABET.index("."),), False)}
    chatml = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    out["chatml"] = (HFTokenizer(chatml, path=str(base)), (chatml.convert_tokens_to_ids("<|im_end|>"),
                                                          chatml.convert_tokens_to_ids("<|endoftext|>")), True)
    qwen_dir = tmp_path_factory.mktemp("qwen_tools")
    qwen = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    qwen.chat_template = QWEN_TOOLS_TEMPLATE
    qwen.save_pretrained(qwen_dir, save_jinja_files=False)
    qwen = AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)
    out["qwen_tools"] = (HFTokenizer(qwen, path=str(qwen_dir)), (qwen.convert_tokens_to_ids("<|im_end|>"),), True)
    llama_dir = tmp_path_factory.mktemp("llama3")
    llama = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    llama.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                              "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    llama.chat_template = LLAMA3_TEMPLATE
    llama.save_pretrained(llama_dir, save_jinja_files=False)
    llama = AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
    assert "<|eot_id|>" in Path(llama_dir, "tokenizer_config.json").read_text()
    out["llama3"] = (HFTokenizer(llama, path=str(llama_dir)), (llama.convert_tokens_to_ids("<|eot_id|>"),), True)
    return out


class Scripted(Environment):
    """Shows the observations it was given, one per step, then says done."""

    def __init__(self, first: Observation, rest: list[Observation], tools: tuple = ()) -> None:
        self.first, self.rest, self._tools = first, list(rest), tools
        self.actions: list = []

    @property
    def features(self):
        return EnvironmentFeatures(owns_reward=True)

    @property
    def tools(self):
        return self._tools

    async def reset(self, record, *, seed):
        return self.first

    async def step(self, action):
        self.actions.append(action)
        if not self.rest:
            return Step(None, reward=1.0, done=True)
        return Step(self.rest.pop(0), reward=0.25)


class FakeStore:
    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}

    async def put(self, cols, *, rows, versions):
        for i, r in enumerate(rows.row_ids.tolist()):
            assert r not in self.rows, f"row {r} written twice"
            self.rows[r] = {c: (v[i].tolist()) for c, v in cols.items()}

    async def ack(self, meta):
        pass


def _text(rng: random.Random, hf: bool) -> str:
    if not hf:
        return "".join(rng.choice(ALPHABET[:-5]) for _ in range(rng.randint(1, 6)))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def _observation(rng: random.Random, hf: bool, vocab: int) -> Observation:
    kind = rng.random()
    if hf and kind < 0.6:
        n = rng.choice((1, 1, 2, 3))
        return Observation(messages=[{"role": rng.choice(("tool", "tool", "user")), "content": _text(rng, hf)}
                                     for _ in range(n)])
    if kind < 0.9:
        return Observation(text=(" " if hf else "") + _text(rng, hf))
    return Observation(token_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 4))])


async def _episode(rng: random.Random, tok, stop_ids, hf: bool, row: int, writer: TrajectoryWriter,
                   log: dict) -> None:
    """One episode through MultiTurn; ``log[row]`` keeps what the engine returned and was shown."""
    vocab = len(tok.hf) if hf else len(ALPHABET)
    eot = stop_ids[0]
    canonical = hf and rng.random() < 0.5  # turns are a text's tokens (+ end-of-turn): the whole-chat oracle applies
    turns = rng.randint(1, 5)
    tools = TOOLS if hf and rng.random() < 0.5 else ()
    if hf:
        first = Observation(messages=[{"role": "user", "content": _text(rng, True)}])
    else:
        first = Observation(text=_text(rng, False))
    if canonical:
        rest = [Observation(messages=[{"role": rng.choice(("tool", "user")), "content": _text(rng, True)}
                                      for _ in range(rng.choice((1, 2)))]) for _ in range(turns - 1)]
    else:
        rest = [_observation(rng, hf, vocab) for _ in range(turns - 1)]
    env = Scripted(first, rest, tools)
    settings_ = EpisodeSettings(open_env=lambda: env, renderer=Renderer(tok, stop_ids), decode=tok.decode,
                                max_turns=8, max_episode_tokens=None, step_timeout_s=None, owns_reward=True)
    ep = MultiTurnEpisodes(settings_).new(row, SimpleNamespace(meta=None, remaining=1), (), 0, None)
    assert await ep.begin() is Progress.CONTINUE, ep.failure
    record = {"prompt": list(ep.prompt), "requests": [], "turns": [], "texts": [], "rest": list(rest),
              "first": first, "tools": tools, "canonical": canonical}
    sampling = SamplingParams(max_new_tokens=16, stop_token_ids=tuple(stop_ids))
    for t in range(turns):
        req = ep.request(sampling)
        record["requests"].append(list(req.prompt_token_ids))
        ends = rng.random() < 0.75
        if canonical:
            text = _text(rng, True)
            toks = list(tok.hf.encode(text, add_special_tokens=False)) + ([eot] if ends else [])
            record["texts"].append(text)
        else:
            toks = [rng.randrange(0, vocab) for _ in range(rng.randint(0, 7))]
            toks = [x for x in toks if x not in stop_ids] + ([rng.choice(stop_ids)] if ends else [])
            toks = toks or [rng.randrange(3, vocab) if hf else 0]
            ends = toks[-1] in stop_ids
        lps = [-rng.random() for _ in toks]
        vers = [rng.randint(0, 3) for _ in toks]
        res = GenerationResult(req.request_id, req.prompt_token_ids, toks, lps, vers,
                               FinishReason.STOP if ends else FinishReason.LENGTH)
        record["turns"].append(res)
        ep.take_turn(res)
        progress = await ep.advance()
        assert progress is (Progress.DONE if t == turns - 1 else Progress.CONTINUE), ep.failure
    log[row] = record
    await writer.write(ep, ep.trajectory())


def _check(row: int, got: dict, rec: dict, tok, stop_ids, hf: bool) -> None:
    prompt, resp, mask = rec["prompt"], got[C.RESPONSE_IDS], got[C.LOSS_MASK]
    full = prompt + resp
    assert len(mask) == len(resp) == len(got[C.BEHAVIOR_LOGPROBS]) == len(got[C.RESPONSE_VERSIONS])
    # the first observation: rendered once (the template with tools and generation prompt, or the text's tokens)
    first = rec["first"]
    if hf:
        want = tok.hf.apply_chat_template(list(first.messages), tools=[t.as_openai() for t in rec["tools"]] or None,
                                          add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert prompt == list(want)
    else:
        assert prompt == tok.encode(first.text)
    pos = 0
    for t, res in enumerate(rec["turns"]):
        while pos < len(mask) and not mask[pos]:
            pos += 1
        # the engine saw exactly the trained tokens before this turn
        assert rec["requests"][t] == full[:len(prompt) + pos], f"row {row} turn {t}: request is not the prefix"
        n = len(res.token_ids)
        assert resp[pos:pos + n] == list(res.token_ids) and all(mask[pos:pos + n])
        assert got[C.BEHAVIOR_LOGPROBS][pos:pos + n] == pytest.approx(list(res.logprobs), abs=1e-7)
        assert got[C.RESPONSE_VERSIONS][pos:pos + n] == list(res.versions)
        assert set(got[C.TURN_IDS][pos:pos + n]) <= {t}
        pos += n
        # the observation after it (none after the last turn) is masked, with log-prob 0 and that turn's version
        end = pos
        while end < len(mask) and not mask[end]:
            end += 1
        if t == len(rec["turns"]) - 1:
            assert end == pos == len(resp)
        else:
            assert end > pos or rec["rest"][t].token_ids == ()
            assert all(v == 0.0 for v in got[C.BEHAVIOR_LOGPROBS][pos:end])
            assert set(got[C.RESPONSE_VERSIONS][pos:end]) <= {res.versions[-1]}
            if rec["rest"][t].token_ids is not None:
                assert resp[pos:end] == list(rec["rest"][t].token_ids)
            elif rec["rest"][t].text is not None:
                assert resp[pos:end] == (list(tok.hf.encode(rec["rest"][t].text, add_special_tokens=False)) if hf
                                         else tok.encode(rec["rest"][t].text))
    assert sum(mask) == sum(len(r.token_ids) for r in rec["turns"])
    if rec["canonical"]:
        chat = list(first.messages)
        for t, text in enumerate(rec["texts"]):
            chat.append({"role": "assistant", "content": text})
            if t < len(rec["rest"]):
                chat.extend(rec["rest"][t].messages)
        whole = tok.hf.apply_chat_template(chat, tools=[x.as_openai() for x in rec["tools"]] or None,
                                           add_generation_prompt=False, tokenize=True)
        whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert full == whole[:len(full)], f"row {row}: the trained sequence is not the whole chat's rendering"
        # what is left is the template's trailer after the last end-of-turn token (ChatML: "\n"; Llama-3: nothing)
        if rec["turns"][-1].finish_reason is FinishReason.STOP:
            assert full[-1] == stop_ids[0] and not any(t in stop_ids for t in whole[len(full):])
        else:  # the last turn was cut: the template's end-of-turn token is what follows it
            assert whole[len(full)] == stop_ids[0]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["char", "chatml", "qwen_tools", "llama3"]), seed=st.integers(0, 2**32 - 1))
def test_the_trained_sequence_is_the_sampled_tokens_plus_the_rendered_observations(tokenizers, name, seed):
    tok, stop_ids, hf = tokenizers[name]
    rng = random.Random(seed)
    store = FakeStore()
    writer = TrajectoryWriter("rollout", interval_s=3600.0, spawn=lambda c: asyncio.ensure_future(c),
                              on_written=lambda: None, columns=MultiTurnEpisodes(EpisodeSettings(
                                  open_env=lambda: None, renderer=Renderer(tok, stop_ids), decode=tok.decode,
                                  owns_reward=True)).columns)
    writer.ctx = SimpleNamespace(store=store, version=0, processed=Counter(), counters=Counter())
    log: dict[int, dict] = {}

    async def main():
        for row in range(EPISODES_PER_EXAMPLE):
            await _episode(rng, tok, stop_ids, hf, row, writer, log)
        await writer.flush()

    asyncio.run(main())
    assert sorted(store.rows) == list(range(EPISODES_PER_EXAMPLE))
    for row, rec in log.items():
        got = store.rows[row]
        _check(row, got, rec, tok, stop_ids, hf)
        assert got[C.TURN_REWARDS] == pytest.approx([0.25] * (len(rec["turns"]) - 1) + [1.0])
        assert got[C.REWARD] == pytest.approx(0.25 * (len(rec["turns"]) - 1) + 1.0)


def test_a_turn_cut_by_length_gets_the_end_of_turn_token_as_masked_glue(tokenizers):
    tok, stop_ids, _ = tokenizers["chatml"]
    r = Renderer(tok, stop_ids)
    obs = Observation(messages=[{"role": "tool", "content": "42"}])
    glue, ids = r.step(obs, history=[{"role": "user", "content": "what is 6 x 7"}], ended_by_stop=False)
    assert glue == [stop_ids[0]]
    glue2, ids2 = r.step(obs, history=[{"role": "user", "content": "what is 6 x 7"}], ended_by_stop=True)
    assert glue2 == [] and ids2 == ids
    # ChatML puts "\n" after <|im_end|>: the step's tokens start with it (kept once, never dropped)
    assert tok.hf.decode(ids).startswith("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")


def test_messages_without_a_chat_template_are_a_recorded_render_error(tokenizers):
    from asyncflow_core.flow.render import RenderError

    tok, stop_ids, _ = tokenizers["char"]
    with pytest.raises(RenderError, match="no chat template"):
        Renderer(tok, stop_ids).reset(Observation(messages=[{"role": "user", "content": "hi"}]))


def test_the_tokens_are_never_reencoded(tokenizers):
    """A sampled turn whose tokens are not the canonical encoding of their text stays as sampled."""
    tok, stop_ids, _ = tokenizers["chatml"]
    text_ids = tok.hf.encode("the answer", add_special_tokens=False)
    odd = [tid for ch in "the answer" for tid in tok.hf.encode(ch, add_special_tokens=False)]  # char by char
    assert odd != text_ids
    env = Scripted(Observation(messages=[{"role": "user", "content": "q"}]),
                   [Observation(messages=[{"role": "tool", "content": "ok"}])])
    s = EpisodeSettings(open_env=lambda: env, renderer=Renderer(tok, stop_ids), decode=tok.decode, owns_reward=True)
    ep = MultiTurnEpisodes(s).new(0, None, (), 0, None)

    async def main():
        await ep.begin()
        toks = odd + [stop_ids[0]]
        ep.take_turn(GenerationResult("a", tuple(ep.prompt), toks, [0.0] * len(toks), [0] * len(toks),
                                      FinishReason.STOP))
        assert await ep.advance() is Progress.CONTINUE
        return ep.request(SamplingParams())

    req = asyncio.run(main())
    assert list(req.prompt_token_ids[len(ep.prompt):len(ep.prompt) + len(odd)]) == odd
    assert env.actions[0].text == "the answer"  # decoded once for the environment
    assert torch.equal(torch.tensor(env.actions[0].token_ids), torch.tensor(odd + [stop_ids[0]]))
