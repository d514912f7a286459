"""The sampling fields beyond temperature and top-p, for the transformers engine, batched.

Example::

    rule = Rules.parse({"top_k": 20, "repetition_penalty": 1.2}, prompt_ids, vocab_size=V)
    logits = process(logits, [(rule, produced), (None, 0)], eos_ids, device)  # whole batch
    rule.observe(token)                                                          # after the pick

What each field does, with vLLM's meaning (the order too: bias, bans, penalties, then the
sampler's top-k/min-p/top-p):

- ``logit_bias``: ``{token: bias}`` added to those logits;
- ``min_tokens``: until that many tokens were made, the EOS tokens and ``stop_token_ids``
  cannot be picked;
- ``repetition_penalty`` (``r``): the logit of every token seen in the prompt or the output is
  divided by ``r`` when positive, multiplied by ``r`` when negative (as transformers'
  ``RepetitionPenaltyLogitsProcessor``);
- ``frequency_penalty`` (``f``) and ``presence_penalty`` (``p``): each token's logit loses
  ``f * count + p * (count > 0)``, its count in the output so far;
- ``top_k`` and ``min_p`` act in :func:`server.engines.transformers.sample.sample` (sampled rows);
- ``stop_token_ids`` end the request (the engine checks :attr:`Rules.stop_ids`);
- ``allowed_token_ids``: every other token's logit is -inf;
- ``bad_words``: each word's token ids (as :func:`bad_words_ids` tokenizes it, vLLM's way:
  the word and, when it tokenizes to as many tokens, the word after a space); when the
  output ends with all of a word's tokens but its last, that last token cannot be picked.

A row with no such field costs nothing: :func:`process` touches only the rows that have
rules, with one indexed write per kind of rule for the whole batch, never a Python loop over
the vocabulary. The output counts a penalised row needs are a vocabulary-sized tensor kept
per request and updated with one indexed add per token.
"""

from __future__ import annotations

import torch

from ...openai.fields import UNSUPPORTED, is_neutral
from ...workers.base import Rejected, malformed

__all__ = ["Rules", "process", "SAMPLING_FIELDS"]

#: The request fields this module (with sample.py's top_k and min_p) honours.
SAMPLING_FIELDS = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words",
)


#: The values of each field that mean "not used": the HTTP layer's (a request with only
#: these has no rules).
NEUTRAL: dict[str, tuple] = {name: UNSUPPORTED[name] for name in SAMPLING_FIELDS}


class Rules:
    """One request's sampling rules (see the module docstring)."""

    __slots__ = (
        "top_k", "min_p", "presence", "frequency", "repetition", "min_tokens", "stop_ids",
        "bias_ids", "bias_values", "counts", "seen", "allowed", "bad", "output",
    )

    def __init__(self) -> None:
        self.top_k = 0
        self.min_p = 0.0
        self.presence = 0.0
        self.frequency = 0.0
        self.repetition = 1.0
        self.min_tokens = 0
        self.stop_ids: frozenset[int] = frozenset()
        self.bias_ids: list[int] = []
        self.bias_values: list[float] = []
        #: Output token counts (a float tensor over the vocabulary), for the penalties.
        self.counts: torch.Tensor | None = None
        #: Tokens of the prompt and the output (a bool tensor), for the repetition penalty.
        self.seen: torch.Tensor | None = None
        #: The tokens ``allowed_token_ids`` leaves (a bool tensor), or None: all.
        self.allowed: torch.Tensor | None = None
        #: ``bad_words`` as token id sequences, and the output so far (kept only for them).
        self.bad: list[list[int]] = []
        self.output: list[int] = []

    @classmethod
    def parse(
        cls, params: dict, prompt: list[int], *, vocab_size: int, device, tokenizer=None
    ) -> Rules | None:
        """The rules of a request's wire params, or None when it has none (the usual case).
        Values were validated by the HTTP layer; token ids are checked here, and a value of
        the wrong type is refused naming its field (Rejected). ``tokenizer`` tokenizes
        ``bad_words``."""
        if all(is_neutral(params.get(name), NEUTRAL[name]) for name in SAMPLING_FIELDS):
            return None
        rules = cls()
        field = "top_k"  # (the one being read)
        try:
            rules.top_k = int(params.get("top_k") or 0)
            if rules.top_k < 0:
                rules.top_k = 0  # -1: off, as 0
            field = "min_p"
            rules.min_p = float(params.get("min_p") or 0.0)
            field = "presence_penalty"
            rules.presence = float(params.get("presence_penalty") or 0.0)
            field = "frequency_penalty"
            rules.frequency = float(params.get("frequency_penalty") or 0.0)
            field = "repetition_penalty"
            rules.repetition = float(params.get("repetition_penalty") or 1.0)
            field = "min_tokens"
            rules.min_tokens = int(params.get("min_tokens") or 0)
            field = "stop_token_ids"
            rules.stop_ids = frozenset(_token_ids(params.get("stop_token_ids") or (),
                                                  vocab_size, field))
            field = "logit_bias"
            bias = params.get("logit_bias") or {}
            rules.bias_ids = _token_ids([int(k) for k in bias], vocab_size, field)
            rules.bias_values = [float(v) for v in bias.values()]
            field = "allowed_token_ids"
            allowed = params.get("allowed_token_ids")
            if allowed is not None:
                rules.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
                rules.allowed[torch.tensor(_token_ids(allowed, vocab_size, field),
                                           dtype=torch.long, device=device)] = True
            field = "bad_words"
            if params.get("bad_words"):
                rules.bad = bad_words_ids(params["bad_words"], tokenizer)
        except (TypeError, ValueError, AttributeError):
            raise malformed(field) from None
        if rules.presence or rules.frequency:
            rules.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if rules.repetition != 1.0:
            rules.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt:
                rules.seen[torch.tensor(prompt, device=device)] = True
        return rules

    def observe(self, token: int) -> None:
        """The request produced ``token``."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.bad:
            self.output.append(token)

    def banned_words(self) -> list[int]:
        """The last tokens of the bad words whose other tokens end the output."""
        out = self.output
        return [w[-1] for w in self.bad
                if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])]


def bad_words_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each word's token ids, and the word's after a space when they differ in their first
    token only but not in number (vLLM's ``SamplingParams.update_from_tokenizer``)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def _token_ids(ids, vocab_size: int, field: str) -> list[int]:
    out = [int(t) for t in ids]
    if any(not 0 <= t < vocab_size for t in out):
        raise Rejected(f"'{field}' token ids must be between 0 and {vocab_size - 1}",
                       param=field)
    return out


def process(
    logits: torch.Tensor, rows: list[tuple[Rules | None, int]], eos_ids: frozenset[int]
) -> torch.Tensor:
    """Apply each row's rules to ``logits`` (``[rows, vocab]``, float); ``rows[i]`` is row
    i's ``(rules or None, tokens produced so far)``. Returns the logits (a new tensor when
    any row has rules, else the same one)."""
    ruled = [(i, r, n) for i, (r, n) in enumerate(rows) if r is not None]
    if not ruled:
        return logits
    logits = logits.float().clone()
    device = logits.device
    # logit_bias, then the bans of min_tokens: one indexed write each for the whole batch.
    at_rows: list[int] = []
    at_ids: list[int] = []
    values: list[float] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, r, produced in ruled:
        if r.bias_ids:
            at_rows += [i] * len(r.bias_ids)
            at_ids += r.bias_ids
            values += r.bias_values
        banned = set(r.banned_words()) if r.bad else set()
        if produced < r.min_tokens:
            banned |= eos_ids | r.stop_ids
        ban_rows += [i] * len(banned)
        ban_ids += sorted(banned)
    if at_rows:
        at = (torch.tensor(at_rows, device=device), torch.tensor(at_ids, device=device))
        logits.index_put_(at, torch.tensor(values, device=device), accumulate=True)
    if ban_rows:
        at = (torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device))
        logits.index_put_(at, torch.tensor(float("-inf"), device=device))
    masked = [(i, r.allowed) for i, r, _ in ruled if r.allowed is not None]
    if masked:
        index = torch.tensor([i for i, _ in masked], device=device)
        keep = torch.stack([m for _, m in masked])
        sub = logits.index_select(0, index).masked_fill(~keep, float("-inf"))
        logits.index_copy_(0, index, sub)
    # Penalties: the penalised rows gathered, changed together, written back.
    rep = [(i, r.seen, r.repetition) for i, r, _ in ruled if r.seen is not None]
    if rep:
        index = torch.tensor([i for i, _, _ in rep], device=device)
        sub = logits.index_select(0, index)
        seen = torch.stack([m for _, m, _ in rep])
        penalty = torch.tensor([p for _, _, p in rep], device=device)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        logits.index_copy_(0, index, sub)
    counted = [(i, r.counts, r) for i, r, _ in ruled if r.counts is not None]
    if counted:
        index = torch.tensor([i for i, _, _ in counted], device=device)
        counts = torch.stack([c for _, c, _ in counted])
        freq = torch.tensor([r.frequency for _, _, r in counted], device=device)[:, None]
        pres = torch.tensor([r.presence for _, _, r in counted], device=device)[:, None]
        sub = logits.index_select(0, index) - freq * counts - pres * (counts > 0)
        logits.index_copy_(0, index, sub)
    return logits
