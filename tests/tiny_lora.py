"""A tiny LoRA adapter for a tiny model (tests/tiny_model.py), built here with ``peft``.

Example::

    path = build_tiny_lora(model_dir, tmp_path / "lora", seed=1)   # rank 8, random weights
    # -> adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes

Both low-rank matrices are random (peft's ``init_lora_weights=False``; its default makes B
zero, an adapter that changes nothing), on the attention projections, so that greedy output
through the adapter differs from the base model's.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["build_tiny_lora"]


def build_tiny_lora(model_dir: str | Path, path: str | Path, *, seed: int = 1,
                    rank: int = 8) -> Path:
    """Write a random rank-``rank`` LoRA adapter of the model in ``model_dir`` to ``path``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(seed)
    get_peft_model(model, config).save_pretrained(path)
    return Path(path)
