"""The vllm engine with vLLM's pooling runner: ``/v1/embeddings`` (``--engine-arg
runner=pooling``, or a model vLLM itself runs as a pooling model).

When and why: a vLLM engine built with ``runner="pooling"`` cannot generate; the vllm
engine (:mod:`server.engines.vllm.engine`) then hands its ``embed`` here and refuses
generation. vLLM pools as the model says (its own reading of sentence-transformers'
``modules.json``, else the architecture's default: last token for a decoder such as
``LlamaModel``) and normalises.

Theory of operation
-------------------
:meth:`VLLMPooling.embed` adds one vLLM request per input (``PoolingParams(task="embed")``,
``dimensions`` for a Matryoshka model), all at once, then runs ``LLMEngine.step`` until they
are done: vLLM's scheduler puts them in one batch (several steps only when they exceed its
``max_num_batched_tokens``). A pooling engine holds no generation requests, so nothing else
is stepped meanwhile. ``forwards`` counts the steps.
"""

from __future__ import annotations

import torch

from ...workers.base import Rejected, one_line
from ...workers.embed import matryoshka, token_rows

__all__ = ["VLLMPooling"]


class VLLMPooling:
    """Embeddings from an ``LLMEngine`` built with the pooling runner."""

    def __init__(self, llm, tokenizer, *, vocab_size: int, max_model_len: int) -> None:
        from vllm import PoolingParams

        self._llm = llm
        self._PoolingParams = PoolingParams
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.forwards = 0
        self._ids = 0

    def describe(self, model_config) -> dict:
        """The HELLO's ``embedding`` entry; embeds once (a warm-up, and the true size of
        the vectors, which a projection may make other than the hidden size)."""
        vectors, _ = self.embed([[0]], {})
        return {"size": len(vectors[0]), "dimensions": matryoshka(model_config)}

    def embed(self, inputs: list, options: dict) -> tuple[list, int]:
        rows = token_rows(inputs, self.tokenizer, vocab_size=self.vocab_size,
                          max_model_len=self.max_model_len)
        params = self._PoolingParams(task="embed", dimensions=options.get("dimensions"))
        names = []
        try:
            for ids in rows:
                self._ids += 1
                name = f"embed-{self._ids}"
                self._llm.add_request(name, {"prompt_token_ids": ids}, params)
                names.append(name)
            results: dict = {}
            while len(results) < len(names):
                for out in self._llm.step():
                    if out.finished:
                        results[out.request_id] = out
                self.forwards += 1
        except ValueError as exc:  # vLLM's own validation of a request
            self._llm.abort_request(names)
            raise Rejected(one_line(exc)) from None
        data = torch.stack([results[n].outputs.data.float() for n in names])
        vectors = torch.nn.functional.normalize(data, dim=-1)
        return list(vectors.cpu().numpy()), sum(len(r) for r in rows)
