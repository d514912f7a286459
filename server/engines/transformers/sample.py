"""Choosing the next token of every row of a batch: greedy, or temperature, top-p, top-k
and min-p.

Example::

    rng = torch.Generator().manual_seed(7)
    tokens = sample(logits, [(0.0, 1.0, None), (0.8, 0.95, rng)])   # one id per row

A row with ``temperature == 0`` takes the argmax (what ``model.generate`` does with
``do_sample=False``). A sampled row divides its logits by the temperature, keeps the
smallest set of most likely tokens whose probabilities add up to ``top_p`` (always at least
one), and draws by inverse CDF with one uniform number from its own generator. The draw
depends only on the row's generator and its logits, not on the other rows of the batch, so a
request with a seed gives the same text whatever else is running (as long as its logits are
the same, which batched floating-point arithmetic only promises up to rounding).
"""

from __future__ import annotations

import torch

__all__ = ["sample"]


Spec = tuple[float, float, "torch.Generator | None"]


def sample(
    logits: torch.Tensor,
    specs: list[Spec],
    top_k: list[int] | None = None,
    min_p: list[float] | None = None,
) -> list[int]:
    """Next token of each row of ``logits`` (``[rows, vocab]``), by ``specs[row]`` =
    ``(temperature, top_p, generator)``; the generator is a CPU one (unused when greedy).
    ``top_k[row]`` (0: off) and ``min_p[row]`` (0: off) narrow a sampled row further: only
    its k most likely tokens, and only tokens at least ``min_p`` times as likely as its most
    likely one (vLLM's order: min-p, then top-k and top-p)."""
    tokens = logits.argmax(-1).tolist()
    sampled = [i for i, (t, _, _) in enumerate(specs) if t > 0]
    if not sampled:
        return tokens
    device = logits.device
    index = torch.tensor(sampled, dtype=torch.long, device=device)
    temps = torch.tensor([specs[i][0] for i in sampled], dtype=torch.float32, device=device)
    top_p = [specs[i][1] for i in sampled]
    ks = [top_k[i] for i in sampled] if top_k else []
    mins = [min_p[i] for i in sampled] if min_p else []
    scaled = logits.index_select(0, index).float() / temps[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if any(mins):
        floor = torch.tensor(mins, dtype=torch.float32, device=device)[:, None]
        probs = probs.masked_fill(probs < floor * probs.max(-1, keepdim=True).values, 0.0)
    order = None
    if any(p < 1.0 for p in top_p) or any(ks):
        probs, order = probs.sort(dim=-1, descending=True)
    if any(ks):
        vocab = probs.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in ks], device=device)[:, None]
        probs = probs.masked_fill(torch.arange(vocab, device=device)[None, :] >= k, 0.0)
    if any(p < 1.0 for p in top_p):
        # Mass of the more likely tokens, of the distribution left after min-p and top-k.
        kept = probs / probs.sum(-1, keepdim=True) if any(mins) or any(ks) else probs
        limit = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
        before = kept.cumsum(-1) - kept
        probs = probs.masked_fill(before >= limit, 0.0)
    cdf = probs.cumsum(-1)
    draws = torch.cat([torch.rand(1, generator=specs[i][2]) for i in sampled]).to(device)
    picks = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    picks = picks.clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        picks = order.gather(-1, picks)
    for row, tok in zip(sampled, picks[:, 0].tolist()):
        tokens[row] = tok
    return tokens
