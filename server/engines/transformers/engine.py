"""The transformers engine: a local Hugging Face causal LM, served with continuous batching.

Example (what a worker process does with ``--engine transformers --model-path DIR``)::

    engine = TransformersEngine(model_path="/models/qwen2.5-0.5b", device="cpu")
    engine.add(1, "Once upon a time", {"max_tokens": 16, "temperature": 0})
    while engine.next_deadline() is not None:
        for rid, text, ntok, finish, err in engine.step(time.monotonic()):
            print(text, end="")

Theory of operation
-------------------
Sans-IO and synchronous, like every engine (:mod:`server.workers.base`): the worker loop
reads its pipe between calls. :meth:`prepare` tokenizes, validates (a client fault raises
:class:`~server.workers.base.Rejected`) and compiles the request's grammar, in a preparation
thread of the worker (:mod:`server.workers.prepare`); :meth:`add_prepared` queues it (``add``
is both, in the caller's thread). Each :meth:`step` is one
round of continuous batching:

1. **decode**: one forward pass gives one token to every running request
   (:class:`~server.engines.transformers.batch.KVBatch`: a left-padded KV cache, one row per request);
2. requests that finished (EOS, a stop string, ``max_tokens``) leave the batch, and their
   cache rows are freed;
3. **admit**: waiting requests, in FIFO order, up to ``max_batch`` running and at most
   ``prefill_tokens`` prompt tokens per step (always at least one request), are prefilled
   in one padded forward pass that also gives them their first token, and join the batch.

So a request joins and leaves between steps, and nothing waits for a whole batch to end.
An abort removes the request's row at once (:meth:`abort` frees its cache before it returns).
:meth:`next_deadline` is 0 while any request is running or waiting (the loop steps as fast
as the model allows) and None when idle.

Text is made here, in the worker (:mod:`server.engines.transformers.text`): the frontend receives
finished UTF-8 text and never loads a tokenizer. See ``docs/transformers.md`` for why.

**Resuming** (docs/routing.md, "Migration"): a request whose params ask (``"token_ids":
true``) gets a note ``{"token_ids": [id]}`` with each token. One with ``"resume":
{"token_ids": G, "text_chars": k}`` continues one whose worker died, exactly. Its prompt
is the prompt and G (one prefill), and everything per request is replayed through G before
it runs:

* the generator (one draw per sampled token, :mod:`server.engines.transformers.sample`);
* the sampling rules (penalties, ``min_tokens``, bad words);
* the grammar's matcher (xgrammar's or llguidance's ``accept_token``);
* the detokenizer and stop matcher.

The text they released past the client's ``k`` characters goes out first.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import tokenizers  # noqa: F401
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the transformers engine needs torch, transformers and tokenizers ({exc}); "
        "install them with: pip install -e '.[transformers]'"
    ) from None

from ...worker_protocol.wire import OutputRow
from ...workers.base import (
    MAX_LOGPROBS,
    Rejected,
    TRUNCATION_FIELDS,
    check_context,
    finite_logprob,
    malformed,
    one_line,
    prompt_param,
    read_sampling,
    truncate_prompt,
)
from . import attention
from .batch import KVBatch, UnsupportedModel, sliding_window
from .grammar import COMPILE_TIMEOUT, MAX_SCHEMA_BYTES, Grammars
from .guidance import failure
from .logits import SAMPLING_FIELDS, Rules, process
from .sample import sample
from .text import RequestText, load_tokenizer
from ...workers.hub import model_files
from ...workers.prep_helper import PROCESS_BYTES, HelperTokenizing
from ...workers.resume import resume_of

__all__ = ["TransformersEngine", "context_length", "load_model", "model_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def model_dtype(dtype: str | None, device: str):
    """``from_pretrained``'s ``dtype`` for ``--dtype`` (None: float32 on a CPU, where
    ``auto`` would pick a half type; else the checkpoint's own); ValueError naming the
    choices for any other value. Shared with the embedding model's loader (embed.py)."""
    if dtype is None:
        dtype = "float32" if device == "cpu" else "auto"
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, not {dtype!r}")
    return "auto" if dtype == "auto" else _DTYPES[dtype]


def load_model(model_path: str | Path, *, device: str = "cpu", dtype: str | None = None,
               attn=None):
    """(model, tokenizer) from a local directory, offline (a hub id is resolved to its
    snapshot first: :func:`server.workers.hub.model_files`); exceptions carry one clear
    line."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    torch_dtype = model_dtype(dtype, device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} requested, but torch {torch.__version__} sees no GPU"
        )
    tokenizer = load_tokenizer(path)
    kwargs = {"dtype": torch_dtype, "local_files_only": True}
    if attn:
        kwargs["attn_implementation"] = attn
    elif device == "cpu" and _attends_through_the_registry(path):
        # grouped-query attention without copying the cache (attention.py)
        kwargs["attn_implementation"] = attention.implementation()
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (ValueError, KeyError):  # a model that takes no implementation but its own
            if attn:
                raise
            kwargs.pop("attn_implementation", None)
            model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model = model.to(device).eval()
    except Exception as exc:
        raise RuntimeError(f"cannot load the model in {path}: {one_line(exc)}") from None
    return model, tokenizer



def _attends_through_the_registry(path: Path) -> bool:
    """Whether the model's class looks its attention up in transformers' registry (where
    :mod:`server.engines.transformers.attention` registers), rather than choosing its own classes
    (Falcon's, say, know only ``eager``, ``sdpa`` and flash attention)."""
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # from_pretrained says what is wrong with the directory
        return False
    return bool(getattr(cls, "_supports_attention_backend", False))


def _top(value) -> int | None:
    """A logprobs request: None (not asked) or how many alternatives (0..MAX_LOGPROBS)."""
    if value is None or value is False:
        return None
    top = int(value)
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError("logprobs out of range")
    return top


def context_length(config, tokenizer) -> int:
    """The model's context length, from its config's usual names (a multimodal config's
    text part), else the tokenizer's; shared with the embedding model (embed.py)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 1_000_000_000:
        return value
    return 2048


class _Req:
    __slots__ = (
        "rid", "prompt", "max_tokens", "temperature", "top_p", "rng", "ignore_eos", "text",
        "produced", "last", "rules", "logprobs", "prompt_logprobs", "matcher", "ids",
        "prompt_ids", "replay", "pending",
    )


class TransformersEngine(HelperTokenizing):
    """See the module docstring. Options come from ``EngineConfig.engine_options``."""

    #: Whether the helper process can compile grammars (``Grammars.remote``, the hook):
    #: it then loads xgrammar at its start.
    remote_grammars = False

    def __init__(
        self,
        *,
        model_path: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch: int = 32,
        max_model_len: int | None = None,
        prefill_tokens: int = 2048,
        model: str | None = None,
        num_threads: int | None = None,
        attn_implementation: str | None = None,
        grammar_max_bytes: int = MAX_SCHEMA_BYTES,
        grammar_timeout: float = COMPILE_TIMEOUT,
        revision: str | None = None,
        prepare_process: bool = True,
        prepare_process_bytes: int = PROCESS_BYTES,
        prepare_process_nice: int = 10,
    ) -> None:
        if not model_path:
            raise ValueError("the transformers engine needs model_path (--model-path DIR)")
        path, hub_id = model_files(model_path, revision=revision)
        if max_batch < 1 or prefill_tokens < 1:
            raise ValueError("max_batch and prefill_tokens must be at least 1")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.model, self.tokenizer = load_model(
            path, device=device, dtype=dtype, attn=attn_implementation
        )
        self._tok = self.tokenizer.backend_tokenizer
        self.helper_options(prepare_process, prepare_process_bytes, prepare_process_nice)
        self._path = path
        limit = context_length(self.model.config, self.tokenizer)
        window = sliding_window(self.model)  # may raise UnsupportedModel: a clear message
        if window is not None:
            limit = min(limit, window)
        if max_model_len is None:
            max_model_len = limit
        elif not 0 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and the model's {limit}")
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.eos_ids = self._eos_ids()
        template = getattr(self.tokenizer, "chat_template", None)
        self.chat_template = template if isinstance(template, str) and template else None
        grammar_ok = importlib.util.find_spec("xgrammar") is not None
        self._grammars: Grammars | None = None
        self._grammar_lock = threading.Lock()
        if grammar_max_bytes < 1 or not grammar_timeout > 0:
            raise ValueError("grammar_max_bytes and grammar_timeout must be positive")
        self._grammar_budget = {"max_bytes": grammar_max_bytes, "timeout": grammar_timeout}
        if grammar_ok:  # now, not on the first request (see _grammar)
            self._grammar()
        self.info = {
            "engine": "transformers",
            "model": model or hub_id or path.resolve().name,
            "max_model_len": max_model_len,
            "chat_template": self.chat_template,
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_batch": max_batch,
            "sampling": [
                *SAMPLING_FIELDS, "chat_template_kwargs", "tools", "return_token_ids",
                "prompt_logprobs", "return_tokens_as_token_ids", *TRUNCATION_FIELDS,
                *(["response_format"] if grammar_ok else []),
            ],
            "logprobs": MAX_LOGPROBS,
            "resume": True,
        }
        self._batch = KVBatch(self.model)
        self._rows: list[_Req] = []  # the batch's rows, in row order
        self._waiting: dict[int, _Req] = {}  # insertion order is FIFO order
        #: [rid, dict] details (logprobs) for the frontend, taken by the worker loop.
        self.notes: list[list] = []

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return frozenset(ids)

    # -- the Engine interface ---------------------------------------------------------------

    def add(self, rid: int, prompt: object, params: dict) -> int:
        return self.add_prepared(rid, self.prepare(prompt, params))

    def prepare(self, prompt: object, params: dict) -> _Req:
        """A request's slow, stateless part (any thread: the worker runs it in a
        preparation thread, :mod:`server.workers.prepare`): tokenizing, the chat template,
        validation, the grammar's compilation. A client fault raises :class:`Rejected`."""
        template_kwargs, tools = params.get("chat_template_kwargs"), params.get("tools")
        ids = truncate_prompt(self.encode_prompt(prompt, template_kwargs, tools), params,
                              self.max_model_len)
        sampling = read_sampling(params)
        max_tokens, temperature, top_p, seed, stop = (
            sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed,
            sampling.stop)
        field = "ignore_eos"  # (the one being read: a malformed one is refused by name)
        try:
            ignore_eos = bool(params.get("ignore_eos", False))
            rules = Rules.parse(params, ids, vocab_size=self.vocab_size, device=self.model.device,
                                tokenizer=self.tokenizer)
            response_format = params.get("response_format")
            field = "logprobs"
            logprobs = _top(params.get("logprobs"))
            field = "prompt_logprobs"
            prompt_logprobs = _top(params.get("prompt_logprobs"))
        except (TypeError, ValueError, AttributeError):
            raise malformed(field) from None
        generated, text_chars = resume_of(params.get("resume")) or ([], 0)
        # No max_tokens (what client libraries send by default): what fits the context.
        max_tokens = check_context(len(ids) + len(generated), max_tokens, self.max_model_len,
                                   prompt_param(prompt))
        req = _Req()
        req.prompt = ids + generated
        req.max_tokens = max_tokens + len(generated)
        req.temperature = temperature
        req.top_p = top_p
        req.rng = None
        if temperature > 0:
            req.rng = torch.Generator()
            req.rng.manual_seed(random.getrandbits(63) if seed is None else seed % (1 << 63))
        req.ignore_eos = ignore_eos
        req.rules = rules
        req.logprobs = logprobs
        req.prompt_logprobs = prompt_logprobs
        req.matcher = None if not response_format else self._grammar().compile(response_format)
        req.text = RequestText(self._tok, ids, stop)
        req.produced = 0
        req.last = -1
        req.ids = bool(params.get("token_ids"))  # a note per token (only when asked)
        req.prompt_ids = bool(params.get("prompt_token_ids"))
        req.replay = generated
        req.pending = ""
        if generated:
            self._replay(req, generated, text_chars)
        return req

    def _replay(self, req: _Req, generated: list[int], text_chars: int) -> None:
        """Bring a resumed request to where its first run stopped (the module docstring;
        its grammar's matcher is replayed in :meth:`add_prepared`, where it is made)."""
        if any(not 0 <= t < self.vocab_size for t in generated):
            raise Rejected("resume: a token id is not the model's", "engine_error")
        if req.rng is not None:  # one uniform draw per sampled token (sample.py)
            torch.rand(len(generated), generator=req.rng)
        sent = []
        for tok in generated:
            if req.rules is not None:
                req.rules.observe(tok)
            text, stopped = req.text.feed(tok)
            if stopped:
                raise Rejected("resume: the generated text already holds a stop string",
                               "engine_error")
            sent.append(text)
        had = "".join(sent)
        if len(had) < text_chars:
            raise Rejected("resume: the client has more text than the generated tokens make",
                           "engine_error")
        req.pending = had[text_chars:]
        req.produced = len(generated)
        req.last = generated[-1]

    def helper_config(self) -> dict:
        """The preparation helper process's configuration
        (:class:`~server.workers.prep_helper.HelperTokenizing`): heavier requests than
        ``prepare_process_bytes`` are prepared there."""
        # Grammars are not compiled there: xgrammar 0.2.8's serialize_json of a compiled
        # 2,000-property schema is 991 MB (149 s), and deserialize_json held the GIL for
        # 5 s (docs/changelog.md, 2026-12-01, "The fix, as built"); they compile in the
        # worker's threads (GIL released).
        # Grammars.remote is the hook, for a small grammar or a later xgrammar; off unless
        # remote_grammars is set before the helper starts: xgrammar imports torch, 10+ s
        # of CPU and ~250 MB at each helper start otherwise spared (prep_child).
        return {
            "model_path": str(self._path), "vocab_size": self.vocab_size,
            "stop_ids": sorted(self.eos_ids), "max_model_len": self.max_model_len,
            "model": self.info["model"],
            "grammar": (self._grammar_budget if self._grammars is not None
                        and self.remote_grammars else None),
        }

    def stop_helper(self) -> None:
        if self._grammars is not None:
            self._grammars.remote = None
        super().stop_helper()

    def add_prepared(self, rid: int, req: _Req) -> int:
        """Queue a request :meth:`prepare` made (the loop's thread; quick)."""
        req.rid = rid
        if req.matcher is not None:  # its compiled grammar, until now
            assert self._grammars is not None
            req.matcher = self._grammars.matcher(req.matcher)
            for tok in req.replay:  # resumed: the grammar where the first run left it
                if not req.matcher.accept_token(tok):
                    raise Rejected("resume: the generated tokens do not follow the grammar",
                                   "engine_error")
        self._waiting[rid] = req
        if req.prompt_ids:  # (in the frame of its accept, before any output)
            self.notes.append([rid, {"prompt_token_ids": list(req.prompt)}])
        return len(req.prompt)

    def abort(self, rid: int) -> bool:
        if self._waiting.pop(rid, None) is not None:
            return True
        for row, req in enumerate(self._rows):
            if req.rid == rid:
                with torch.inference_mode():  # the batch's tensors are inference tensors
                    order = self._batch.remove([row])
                self._rows = [self._rows[i] for i in order]
                return True
        return False

    def next_deadline(self) -> float | None:
        return 0.0 if self._rows or self._waiting else None

    def running(self) -> int:
        return len(self._rows)

    def waiting(self) -> int:
        return len(self._waiting)

    def cached_tokens(self) -> int:
        """KV-cache slots held by the running batch (padding included); 0 when idle."""
        return self._batch.cached_tokens()

    def step(self, now: float) -> list[OutputRow]:
        outputs: list[list] = []
        try:
            with torch.inference_mode():
                if self._rows:
                    logits = self._batch.decode([r.last for r in self._rows])
                    self._advance(self._rows, logits, outputs)
                if self._waiting and len(self._rows) < self.max_batch:
                    group = self._admit()
                    self._rows.extend(group)
                    for req in group:
                        if req.prompt_logprobs is not None:
                            self._prompt_logprobs(req)
                    logits = self._batch.prefill([r.prompt for r in group])
                    self._advance(group, logits, outputs)
        except UnsupportedModel as exc:
            self._fail_all(outputs, str(exc))
        except Exception as exc:  # the model failed (out of memory, ...): fail, keep serving
            print(f"transformers engine: step failed: {exc!r}", file=sys.stderr)
            self._fail_all(outputs, f"the model failed: {one_line(exc)}")
        return outputs

    # -- internals --------------------------------------------------------------------------

    def _admit(self) -> list[_Req]:
        room = self.max_batch - len(self._rows)
        group: list[_Req] = []
        budget = self.prefill_tokens
        for req in self._waiting.values():
            if len(group) >= room or (group and len(req.prompt) > budget):
                break
            group.append(req)
            budget -= len(req.prompt)
        for req in group:
            del self._waiting[req.rid]
        return group

    def _advance(self, reqs: list[_Req], logits, outputs: list[list]) -> None:
        """Sample one token for each of ``reqs`` (the rows ``logits`` belong to), emit their
        outputs, and drop the ones that finished from the batch."""
        asked = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        raw = None
        if asked:  # the model's own distribution, before any sampling rule (as vLLM's)
            index = torch.tensor(asked, device=logits.device)
            raw = torch.log_softmax(logits.index_select(0, index).float(), -1)
        specs = [(r.temperature, r.top_p, r.rng) for r in reqs]
        constrained = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
        if constrained:  # structured output: only grammatical tokens (in place, after raw)
            assert self._grammars is not None
            logits = logits.float()
            self._grammars.mask(logits, constrained)
        if any(r.rules is not None for r in reqs):
            logits = process(logits, [(r.rules, r.produced) for r in reqs], self.eos_ids)
            top_k = [r.rules.top_k if r.rules else 0 for r in reqs]
            min_p = [r.rules.min_p if r.rules else 0.0 for r in reqs]
            tokens = sample(logits, specs, top_k, min_p)
        else:
            tokens = sample(logits, specs)
        if raw is not None:
            for row, i in enumerate(asked):
                entry = self._logprob_entry(raw[row], tokens[i], reqs[i].logprobs)
                self.notes.append([reqs[i].rid, {"logprobs": [entry]}])
        finished = []
        for req, tok in zip(reqs, tokens):
            req.produced += 1
            req.last = tok
            rules = req.rules
            if rules is not None:
                rules.observe(tok)
            matcher = req.matcher
            if matcher is not None and not matcher.accept_token(tok) \
                    and (why := failure(matcher)):  # llguidance gave up: no half document
                outputs.append(OutputRow(req.rid, "", 0, "error", [
                    "engine_error", f"structured output failed: {why}"]))
                finished.append(req)
                continue
            if (
                (tok in self.eos_ids and not req.ignore_eos)
                or (rules is not None and tok in rules.stop_ids)
                or (matcher is not None and matcher.is_terminated())
            ):
                text, _ = req.text.finish()
                finish = "stop"
            else:
                text, stopped = req.text.feed(tok)
                finish = "stop" if stopped else None
                if finish is None and req.produced >= req.max_tokens:
                    more, stopped = req.text.finish()
                    text += more
                    finish = "stop" if stopped else "length"
            if req.ids:  # every token, the EOS one included (as vLLM's token_ids)
                self.notes.append([req.rid, {"token_ids": [tok]}])
            if req.pending:  # a resume's text the client does not have: first
                text, req.pending = req.pending + text, ""
            outputs.append(OutputRow(req.rid, text, 1, finish, None))
            if finish is not None:
                finished.append(req)
        if finished:
            gone = {id(r) for r in finished}
            rows = [i for i, r in enumerate(self._rows) if id(r) in gone]
            order = self._batch.remove(rows)  # the batch's new row order
            self._rows = [self._rows[i] for i in order]

    def _grammar(self) -> Grammars:
        """The grammars of this model's tokenizer, made at engine start when xgrammar is
        installed. Its import and the tokenizer's analysis hold the GIL for half a second
        or more, which on the first structured request would stop the step loop (measured:
        docs/changelog.md, 2026-12-01, "Why the transformers rows miss the target"). A worker
        that is still starting has no streams."""
        with self._grammar_lock:  # preparation threads: one makes it
            if self._grammars is None:
                if importlib.util.find_spec("xgrammar") is None:
                    raise Rejected("response_format needs xgrammar, which is not installed")
                self._grammars = Grammars(
                    self.tokenizer, vocab_size=self.vocab_size, stop_ids=self.eos_ids,
                    guidance=True, **self._grammar_budget,
                )
            return self._grammars

    def statistics(self) -> dict:
        """The grammar cache's figures (:meth:`Grammars.statistics`), once one was used."""
        return {"grammars": None if self._grammars is None else self._grammars.statistics()}

    def close(self) -> None:
        self.stop_helper()
        if self._grammars is not None:
            self._grammars.close()

    def _logprob_entry(self, logprobs, token: int, top: int) -> list:
        """``[text, logprob, [[alt_text, alt_logprob, alt_id], ...], id, rank]`` of a chosen
        token (the ``top`` most likely alternatives, best first; its rank: 1 + how many
        tokens are more likely), from a row of log-probabilities."""
        decode = self.tokenizer.decode
        alts = []
        if top:
            values, ids = logprobs.topk(top)
            pairs = zip(values.tolist(), ids.tolist())
            alts = [[decode([t]), finite_logprob(v), t] for v, t in pairs]
        chosen = logprobs[token]
        rank = int((logprobs > chosen).sum()) + 1
        return [decode([token]), finite_logprob(float(chosen)), alts, token, rank]

    def _prompt_logprobs(self, req: _Req) -> None:
        """The prompt's logprobs (``echo``, ``prompt_logprobs``), from one forward pass over
        it: entry i is the
        log-probability of prompt token i after tokens 0..i-1 (None for the first)."""
        ids = req.prompt
        logits = self.model(torch.tensor([ids], device=self.model.device)).logits[0]
        rows = torch.log_softmax(logits.float(), -1)
        entries: list = [[self.tokenizer.decode([ids[0]]), None, [], ids[0], None]]
        for i in range(1, len(ids)):
            entries.append(self._logprob_entry(rows[i - 1], ids[i], req.prompt_logprobs))
        self.notes.append([req.rid, {"prompt_logprobs": entries}])

    def _fail_all(self, outputs: list[list], message: str) -> None:
        done = {o[0] for o in outputs if o[3] is not None}
        for req in self._rows:
            if req.rid not in done:
                outputs.append(OutputRow(req.rid, "", 0, "error", ["engine_error", message]))
        self._rows = []
        self._batch.clear()
