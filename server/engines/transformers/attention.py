"""Attention for the transformers engine's padded batch on a CPU: grouped-query attention
without copying the cache.

Why: the running batch is left-padded (:mod:`server.engines.transformers.batch`), so every decode step
passes an attention mask. transformers' ``sdpa`` attention then expands a grouped-query
model's keys and values to one copy per query head (``repeat_kv``) before calling
``scaled_dot_product_attention``, because CUDA's fast kernels take no mask with grouped
heads. So each step copied every row's whole cache ``num_key_value_groups`` times over, in
every layer: on the tiny model (2 key/value heads for 4 query heads), 64 rows of 320 tokens,
about 60% of a 70 ms step. On a CPU, torch's kernel takes the mask and grouped heads
together (``enable_gqa=True``) and computes the same numbers (measured: equal to the last
bit) in a seventh of the time.

:func:`implementation` registers this as an attention implementation of its own name with
transformers (an addition to its registry, used only by models loaded with that name; the
mask is ``sdpa``'s) and returns the name; :func:`server.engines.transformers.engine.load_model` asks for it
on a CPU when the operator named no implementation. Anything this does not cover (no mask,
no grouped heads, a device other than a CPU, dropout in training, a position bias) goes to
transformers' own ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["NAME", "implementation"]

NAME = "trio_llm_cpu_sdpa"


def implementation() -> str:
    """Register the attention (idempotent) and return its name for ``attn_implementation``."""
    AttentionInterface.register(NAME, _forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def _forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        attention_mask is None
        or groups <= 1
        or query.device.type != "cpu"
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            **kwargs,
        )
    # With a mask transformers' sdpa never asks for a causal kernel (is_causal is False):
    # the mask says it all, as here.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None
