"""A real local chat checkpoint for tests and examples, built without a hub or a network.

:func:`build_local_chat_checkpoint` writes a directory laid out exactly like a
downloaded instruct model: a small randomly initialised Qwen2
(``config.json`` + ``model.safetensors``), a byte-level BPE tokenizer trained
on the fly with ``tokenizers`` on a generated corpus (``tokenizer.json``,
``tokenizer_config.json`` holding a ChatML chat template and the special tokens
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), and a
``generation_config.json`` whose ``eos_token_id`` lists ``<|im_end|>`` and
``<|endoftext|>``, as Qwen2.5-Instruct's does. Everything is written with
``save_pretrained``, so ``AutoTokenizer``/``AutoModelForCausalLM`` load it by
path like any checkpoint. The weights are random (seeded): the model says
nothing sensible, but every byte of the loading path is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the special tokens, in id order (0, 1, 2)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML, as Qwen2.5-Instruct writes it (without tool calls)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: the architecture: two layers, small enough to train a few steps on a CPU in a second
TINY_CHAT_QWEN2: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def _corpus() -> list[str]:
    """Chat-shaped arithmetic text: what the tokenizer's merges are learned from (deterministic)."""
    lines = []
    for a in range(10):
        for b in range(10):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"Compute {a} times {b}. #### {a * b}")
    lines += [
        "You are a helpful assistant. Answer with the number only.",
        "user", "assistant", "system", "tool",
        "Question: how many apples are left? Let's think step by step.",
    ]
    return lines


def build_local_chat_checkpoint(path: str | Path, *, vocab_size: int = 384, seed: int = 0) -> Path:
    """Write the checkpoint into ``path`` (created) and return it; the same arguments give the same files."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=TINY_CHAT_QWEN2["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template in tokenizer_config.json, as hubs ship it

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], **TINY_CHAT_QWEN2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
                     bos_token_id=None, do_sample=True).save_pretrained(out)
    return out
