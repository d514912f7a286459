"""A tiny random-weight vision-language model, built offline for the vllm image tests: an
Idefics3 (a SigLIP-like vision tower, pixel shuffle, a Llama) with its processor and the
tokenizer of tests/tiny_model.py. vLLM's CPU build serves it without torchvision (LLaVA's and
Qwen2-VL's processors need torchvision). Each ``<image>`` of a prompt becomes 19 tokens.

``python -m tests.tiny_vlm reference MODEL_DIR CASES_JSON``: ``vllm.LLM`` on it, greedy,
one ``RESULT <JSON>`` line out per case (a case: ``{"ids": [...], "images": [PNG bytes in
base64], "max_tokens": n}``; out: ``{"text", "prompt_tokens"}``), for
tests/test_vllm_images.py (vLLM in a process of its own, as tests/vllm_reference.py
explains). :func:`reference_llm` and :func:`reference`: the same in a process of the
caller's.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import sys
from pathlib import Path

IMAGE = "<image>"
# tests/tiny_model.py's <|role|> lines; list contents (OpenAI parts) render text parts as text
# and image parts as one <image> placeholder, which vLLM expands (fake, global tag, N x <image>).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] in ('image', 'image_url') %}" + IMAGE + "{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_vlm(path, *, hidden=256, heads=4, layers=2, vocab=1000, ctx=1024,
                   v_hidden=128, v_heads=4, v_layers=2, image_size=64, patch=8, scale=2,
                   split=False, seed=0):
    """Build the model, its processor and tokenizer in ``path`` (its 64 x 64 images, one
    tile each unless ``split``); returns ``path``."""
    import torch
    import transformers
    from transformers import (
        AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil, Idefics3Processor, Idefics3VisionConfig, LlamaConfig,
    )
    from tests.tiny_model import build_tiny_model

    transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    text_dir = build_tiny_model(path / "_text", hidden_size=hidden, heads=heads,
                                layers=layers, vocab_size=vocab, max_position_embeddings=ctx)
    tok = AutoTokenizer.from_pretrained(text_dir)
    shutil.rmtree(text_dir)
    extra = ["<fake_token_around_image>", IMAGE, "<end_of_utterance>", "<global-img>"]
    if split:
        extra += [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": extra})
    image_seq_len = (image_size // patch) ** 2 // scale ** 2
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=split,
        size={"longest_edge": image_size * (2 if split else 1)},
        max_image_size={"longest_edge": image_size})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                                  image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE)
    image_id = tok.convert_tokens_to_ids(IMAGE)
    eos_id = tok.eos_token_id

    text_config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=ctx,
        tie_word_embeddings=True, initializer_range=0.25, bos_token_id=None,
        eos_token_id=eos_id, pad_token_id=eos_id)
    vision_config = Idefics3VisionConfig(
        hidden_size=v_hidden, intermediate_size=v_hidden * 2, num_hidden_layers=v_layers,
        num_attention_heads=v_heads, image_size=image_size, patch_size=patch)
    config = Idefics3Config(
        vision_config=vision_config, text_config=text_config, image_token_id=image_id,
        scale_factor=scale, tie_word_embeddings=True, pad_token_id=eos_id)
    config.eos_token_id = eos_id
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a quieter EOS, as tests/tiny_model.py does
        model.get_input_embeddings().weight[eos_id].mul_(0.1)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def reference_llm(model: str):
    """``vllm.LLM`` on the model as :func:`reference` runs it."""
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True,
               kv_cache_memory_bytes=64 << 20, limit_mm_per_prompt={"image": 2}, seed=0)


def reference(model: str, cases: list, llm=None) -> list[dict]:
    """Greedy ``vllm.LLM.generate`` of each case (see the module docstring), on ``llm``
    (:func:`reference_llm`'s) if given."""
    from PIL import Image
    from vllm import SamplingParams

    llm = llm or reference_llm(model)
    out = []
    for case in cases:
        images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB")
                  for b in case["images"]]
        [result] = llm.generate(
            [{"prompt_token_ids": case["ids"], "multi_modal_data": {"image": images}}],
            SamplingParams(temperature=0, max_tokens=case["max_tokens"]), use_tqdm=False)
        out.append({"text": result.outputs[0].text,
                    "prompt_tokens": len(result.prompt_token_ids)})
    return out


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        for line in reference(sys.argv[2], json.loads(sys.argv[3])):
            print("RESULT " + json.dumps(line), flush=True)  # (vLLM logs to stdout too)
