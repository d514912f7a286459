"""Choosing the next token of every row of a batch: greedy, or temperature and top-p.

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


def sample(logits: torch.Tensor, specs: list[Spec]) -> list[int]:
    """Next token of each row of ``logits`` (``[rows, vocab]``), by ``specs[row]`` =
    ``(temperature, top_p, generator)``; the generator is a CPU one (unused when greedy)."""
    tokens = logits.argmax(-1).tolist()
    sampled = [i for i, (t, _, _) in enumerate(specs) if t > 0]
    if not sampled:
        return tokens
    device = logits.device
    index = torch.tensor(sampled, dtype=torch.long, device=device)
    temps = torch.tensor([specs[i][0] for i in sampled], dtype=torch.float32, device=device)
    top_p = [specs[i][1] for i in sampled]
    scaled = logits.index_select(0, index).float() / temps[:, None]
    probs = torch.softmax(scaled, dim=-1)
    order = None
    if any(p < 1.0 for p in top_p):
        probs, order = probs.sort(dim=-1, descending=True)
        limit = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
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
