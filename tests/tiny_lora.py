"""A tiny LoRA adapter for a tiny model (tests/tiny_model.py), written here as peft writes one.

Example::

    path = build_tiny_lora(model_dir, tmp_path / "lora", seed=1)   # rank 8, random weights
    # -> adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes

Both low-rank matrices are random (as peft's ``init_lora_weights=False``, kaiming-uniform
bounds; its default makes B zero, an adapter that changes nothing), on the attention
projections, so that greedy output through the adapter differs from the base model's. The
files are written directly (torch and safetensors, which the engines' extras bring): the
tests need no ``peft``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_tiny_lora"]

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_tiny_lora(model_dir: str | Path, path: str | Path, *, seed: int = 1,
                    rank: int = 8) -> Path:
    """Write a random rank-``rank`` LoRA adapter of the model in ``model_dir`` to ``path``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {  # (in, out) of each projection
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
    }
    generator = torch.Generator().manual_seed(seed)

    def uniform(rows: int, cols: int) -> torch.Tensor:  # kaiming-uniform bound 1/sqrt(fan_in)
        bound = 1.0 / cols ** 0.5
        return (torch.rand(rows, cols, generator=generator) * 2 - 1) * bound

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in _TARGETS:
            n_in, n_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = uniform(rank, n_in).contiguous()
            tensors[f"{key}.lora_B.weight"] = uniform(n_out, rank).contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(_TARGETS), "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=2))
    return out
