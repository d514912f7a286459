"""Prompt tokenizing through the ``tokenizers`` library directly (server.workers.base
encode_text, the GIL-free path for huge prompts) gives transformers' ``encode``'s ids."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402
from tokenizers import processors  # noqa: E402

from server.workers.base import encode_text  # noqa: E402
from tests.tiny_model import EOS, SPECIAL_TOKENS, WORDS, build_tiny_model  # noqa: E402

TEXTS = [
    "", "a", "x" * 5000, "hello world", " leading and trailing  ", "héllo 日本 🙂\n\ttabs",
    f"{EOS} inside {SPECIAL_TOKENS[1]}text{SPECIAL_TOKENS[2]}", " ".join(WORDS) * 3,
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("fast") / "tiny")
    return transformers.AutoTokenizer.from_pretrained(path)


def _with_bos(tokenizer):
    """The tiny tokenizer with a post-processor that adds special tokens (as Llama's)."""
    backend = tokenizer.backend_tokenizer
    eos = backend.token_to_id(EOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos)])
    return tokenizer


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("special", [True, False])
def test_the_fast_path_gives_transformers_ids(tmp_path, tokenizer, bos, special):
    tok = tokenizer
    if bos:
        tok.save_pretrained(tmp_path)
        tok = _with_bos(transformers.AutoTokenizer.from_pretrained(tmp_path))
    for text in TEXTS:
        expected = tok.encode(text, add_special_tokens=special)
        assert encode_text(tok, text, add_special_tokens=special) == expected, text
    if bos and special:  # the post-processor did add one: the case is not vacuous
        assert tok.encode("a")[0] == tok.backend_tokenizer.token_to_id(EOS)


def test_a_tokenizer_that_splits_special_tokens_gives_its_own_ids(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, split_special_tokens=True)
    text = f"{EOS} and {SPECIAL_TOKENS[1]}"
    assert encode_text(tok, text) == tok.encode(text) != tokenizer.encode(text)
