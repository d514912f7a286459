"""The transformers engine for an embedding model: ``/v1/embeddings``, one forward per batch.

Example (what a worker process does with ``--engine transformers --model-path DIR`` when DIR
holds an embedding model)::

    engine = TransformersEmbedder(model_path="/models/bge-small", device="cpu")
    vectors, prompt_tokens = engine.embed(["a cat", [101, 2023, 102]], {})

When
----
:func:`is_embedding_model` decides, from the directory alone, which engine a transformers
worker builds (:func:`server.workers.main.build_engine`): a sentence-transformers directory
(``modules.json``), or a model whose ``architectures`` have no language-model head (such as
``BertModel``, ``LlamaModel``), is an embedding model; anything else generates. An embedding
model refuses generation requests (400), and a generation model refuses embeddings.

Theory of operation
-------------------
:meth:`TransformersEmbedder.embed` is called by the worker loop between steps (a CALL
frame with ``"op": "embed"``, see :mod:`server.workers.embed`) and answers at once. Every
input of the request is tokenized, right-padded into one batch and run through the model
in **one** forward pass (:attr:`forwards` counts them). The vectors are pooled as the model
says (sentence-transformers' ``1_Pooling/config.json``: mean, CLS or last token; mean when
there is none), optionally cut to ``dimensions`` (a Matryoshka model only) and
L2-normalised. The model holds no state between calls: ``add`` refuses every request, and
the engine is never busy (``next_deadline`` is None).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from ...workers.base import HFTokenizing, Rejected, one_line
from ...workers.embed import matryoshka, token_rows
from .engine import context_length, model_dtype

__all__ = ["TransformersEmbedder", "is_embedding_model", "pooling_of", "pool"]

#: Architecture name endings of models with a language-model head (generation models).
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")

#: sentence-transformers' pooling flags -> our pooling names.
_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot read {path}: {one_line(exc)}") from None


def is_embedding_model(model_path: str) -> bool:
    """Whether the model directory holds an embedding model (see the module docstring)."""
    path = Path(model_path).expanduser()
    if (path / "modules.json").is_file():
        return True
    config = path / "config.json"
    if not config.is_file():
        return False  # the generation engine's loader says what is wrong
    data = _read_json(config)
    architectures = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(architectures, list) or not architectures:
        return False
    return not any(str(a).endswith(_GENERATIVE) for a in architectures)


def pooling_of(model_path: str) -> str:
    """``mean``, ``cls`` or ``last``: the pooling sentence-transformers' config names (its
    ``modules.json`` Pooling module), else ``mean``. Any other pooling (max, weighted mean,
    several at once) is refused: we would serve other vectors than the model's."""
    path = Path(model_path).expanduser()
    modules = path / "modules.json"
    if not modules.is_file():
        return "mean"
    entries = _read_json(modules)
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Pooling"):
            config = _read_json(path / str(entry.get("path", "")) / "config.json")
            if not isinstance(config, dict):
                break
            modes = [name for flag, name in _POOLING_FLAGS.items() if config.get(flag)]
            others = [k for k, v in config.items()
                      if k.startswith("pooling_mode_") and v and k not in _POOLING_FLAGS]
            if len(modes) != 1 or others:
                raise RuntimeError(f"unsupported pooling in {path}: {config} (supported: "
                                   "exactly one of mean, CLS, last token)")
            return modes[0]
    return "mean"


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per row of ``hidden`` ([batch, seq, size]; ``mask`` [batch, seq], 1 on
    real tokens, right-padded), unnormalised."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


class TransformersEmbedder(HFTokenizing):
    """See the module docstring. Options as for the transformers engine (those about
    generation, ``max_batch`` and ``prefill_tokens``, are accepted and unused)."""

    def __init__(
        self,
        *,
        model_path: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_model_len: int | None = None,
        model: str | None = None,
        num_threads: int | None = None,
        max_batch: int | None = None,
        max_embed_tokens: int = 16384,
    ) -> None:
        if not model_path:
            raise ValueError("the transformers engine needs model_path (--model-path DIR)")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.pooling = pooling_of(model_path)
        self.model, self.tokenizer = _load(model_path, device=device, dtype=dtype)
        limit = context_length(self.model.config, self.tokenizer)
        if max_model_len is None:
            max_model_len = limit
        elif not 0 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and the model's {limit}")
        self.max_model_len = max_model_len
        #: Most padded tokens (inputs x the longest) one request may run: its one forward
        #: holds the worker loop, and every other request on the worker waits for it.
        self.max_embed_tokens = max(max_embed_tokens, max_model_len)
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.chat_template = None
        size = int(self.model.config.hidden_size)
        self.info = {
            "engine": "transformers",
            "model": model or Path(model_path).expanduser().resolve().name,
            "max_model_len": max_model_len,
            "chat_template": None,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "generate": False,
            "embedding": {"size": size, "dimensions": matryoshka(self.model.config),
                          "pooling": self.pooling},
        }
        #: Forward passes run (one per embed call, however many inputs it has).
        self.forwards = 0

    # -- the Engine interface: no generation -------------------------------------------------

    def add(self, rid: int, prompt: object, params: dict) -> int:
        raise Rejected(f"model {self.info['model']!r} is an embedding model: it serves "
                       "/v1/embeddings, not completions")

    def abort(self, rid: int) -> bool:
        return False

    def next_deadline(self) -> float | None:
        return None

    def step(self, now: float) -> list:
        return []

    def running(self) -> int:
        return 0

    def waiting(self) -> int:
        return 0

    # -- embeddings ---------------------------------------------------------------------------

    def embed(self, inputs: list, options: dict) -> tuple[list, int]:
        """(one L2-normalised vector per input, the prompt tokens of all): one forward
        pass for the whole batch. ``options``: ``dimensions`` (already checked against
        ``info["embedding"]`` by the caller) cuts the vectors first."""
        rows = token_rows(inputs, self.tokenizer, vocab_size=self.vocab_size,
                          max_model_len=self.max_model_len)
        longest = max(len(r) for r in rows)
        if longest * len(rows) > self.max_embed_tokens:
            raise Rejected(f"input: {len(rows)} inputs of up to {longest} tokens are more than "
                           f"the {self.max_embed_tokens} padded tokens one request may hold "
                           "here; send fewer inputs per request", param="input")
        device = self.model.device
        batch = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        batch, mask = batch.to(device), mask.to(device)
        with torch.inference_mode():
            hidden = self.model(input_ids=batch, attention_mask=mask).last_hidden_state
            self.forwards += 1
            vectors = pool(hidden, mask, self.pooling).float()
            dimensions = options.get("dimensions")
            if dimensions:
                vectors = vectors[:, :dimensions]
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return list(vectors.cpu().numpy()), sum(len(r) for r in rows)


def _load(model_path: str, *, device: str, dtype: str | None):
    """(model without head, tokenizer), offline; one clear line on failure."""
    path = Path(model_path).expanduser()
    torch_dtype = model_dtype(dtype, device)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise RuntimeError(f"cannot load the tokenizer in {path}: {one_line(exc)}") from None
    kwargs = {"dtype": torch_dtype, "local_files_only": True}
    try:
        model = transformers.AutoModel.from_pretrained(path, **kwargs).to(device).eval()
    except Exception as exc:
        raise RuntimeError(f"cannot load the model in {path}: {one_line(exc)}") from None
    return model, tokenizer
