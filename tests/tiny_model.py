"""Build a tiny random causal LM and its tokenizer into a directory, offline, in seconds.

Example::

    from tests.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path / "tiny")        # a Llama-like model, ~200k parameters
    model = AutoModelForCausalLM.from_pretrained(path)   # loads like any local checkpoint

The tokenizer is a byte-level BPE trained here (with the ``tokenizers`` library) on a
generated corpus of English, accented, CJK and emoji words, so multi-byte characters span
several tokens in the ways a real tokenizer splits them. It has a simple chat template
(``<|role|>content`` lines, then ``<|assistant|>``; tools Hermes-style, see
:data:`CHAT_TEMPLATE`) unless ``chat_template=False``, and
``<|endoftext|>`` as its EOS token.

With ``ascii_only=True`` the corpus is English and made-up ASCII words and every token but
the special ones is whole printable ASCII (or a newline). With the default tokenizer about
two thirds of the tokens are bytes or pieces of a multi-byte character; a random model
samples them, and a detokenizer (ours, vLLM's) rightly holds text back until a character is
whole (about one sampled token in five): an event then carries several tokens after a gap
of several steps. Benchmarks that read the gaps between events use the ASCII model, so that
each token is an event (a special token, which decodes to nothing, still is not).

The weights are random (seeded), drawn with a larger spread than usual so that the logits
are far apart: greedy decoding is then a stable function of the prompt, and a batched
forward pass (whose float rounding differs from an unbatched one) picks the same tokens as
``model.generate``. The output is gibberish in all the scripts of the corpus.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

__all__ = ["build_tiny_model", "CHAT_TEMPLATE", "EOS", "SPECIAL_TOKENS", "WORDS"]

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>"]
#: ``<|role|>content`` lines; with tools, Hermes-style as Qwen2.5's: the tools listed in a
#: system line, assistant calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
#: tool results as ``<tool_response>...</tool_response>`` in a user line.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call these functions:"
    "{% for t in tools %} {{ t | tojson }}{% endfor %}. To call one, answer "
    '<tool_call>{"name": <name>, "arguments": <object>}</tool_call>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{{ '\\n' }}"
    "{% else %}<|{{ m['role'] }}|>{% if m['name'] %}{{ m['name'] }}: {% endif %}"
    "{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking %}<think>{% endif %}"
)

#: The corpus vocabulary: ASCII, accented Latin, CJK, emoji (some with ZWJ sequences).
WORDS = (
    "the", "a", "model", "token", "stream", "trio", "worker", "pipe", "batch", "step",
    "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "server",
    "café", "naïve", "résumé", "über", "façade", "jalapeño", "Ærø", "smörgåsbord",
    "日本", "日本語", "数据", "模型", "你好", "世界", "東京", "한국어", "안녕",
    "Привет", "🙂", "🚀", "🎉", "👍🏽", "👨‍👩‍👧", "🇯🇵", "✨", "🔥", "€", "∑", "→",
)


def _corpus(seed: int, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(3, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        sep = rng.choice((" ", " ", " ", "", ", "))
        out.append(sep.join(words) + rng.choice((".", "!", "?", "", "\n")))
    return out


def _ascii_corpus(seed: int, lines: int = 2000) -> list[str]:
    """English and made-up lowercase words: enough distinct ones for a vocabulary of
    thousands of merges."""
    rng = random.Random(seed)
    english = [w for w in WORDS if w.isascii()]
    made_up = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
               for _ in range(3000)]
    out = []
    for _ in range(lines):
        n = rng.randint(3, 14)
        words = [rng.choice(english) if rng.random() < 0.3 else rng.choice(made_up)
                 for _ in range(n)]
        out.append(rng.choice((" ", " ", ", ")).join(words) + rng.choice((".", "!", "?", "\n")))
    return out


def _train_tokenizer(vocab_size: int, seed: int, ascii_only: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if ascii_only:  # the byte-level characters of printable ASCII and newline only
        text = "".join(chr(b) for b in range(32, 127)) + "\n"
        alphabet = sorted({c for piece, _ in byte_level.pre_tokenize_str(text) for c in piece})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_ascii_corpus(seed) if ascii_only else _corpus(seed),
                            trainer=trainer)
    return tok


def build_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 640,
    hidden_size: int = 64,
    layers: int = 4,
    heads: int = 4,
    max_position_embeddings: int = 256,
    chat_template: bool = True,
    init_scale: float = 0.25,
    sliding_window: int | None = None,
    seed: int = 0,
    ascii_only: bool = False,
) -> Path:
    """Write a tiny Llama-like model and its tokenizer to ``path``; returns ``path``.

    With ``sliding_window`` it is a Mistral (the same architecture, with sliding-window
    attention over that many tokens)."""
    import torch
    import transformers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
    )

    transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = _train_tokenizer(vocab_size, seed, ascii_only)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    eos_id = backend.token_to_id(EOS)
    config_class, model_class, extra = LlamaConfig, LlamaForCausalLM, {}
    if sliding_window is not None:
        config_class, model_class = MistralConfig, MistralForCausalLM
        extra = {"sliding_window": sliding_window}
    config = config_class(
        vocab_size=backend.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=init_scale,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        # A quieter EOS: generations run to max_tokens unless a test arranges otherwise.
        model.get_input_embeddings().weight[eos_id].mul_(0.1)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(path)
    return path
