"""What a worker process needs from an engine: a synchronous, sans-IO step machine.

The worker loop (:mod:`server.workers.main`) owns the pipe and the clock; an engine only
answers calls. An engine is a class with::

    info: dict                              sent to the frontend in HELLO
    add(rid, prompt, params) -> int         prompt_tokens; raise Rejected for client faults
    abort(rid) -> bool                      True when it held rid (it then forgets it)
    next_deadline() -> float | None         monotonic time to call step() next; None when idle
    step(now) -> list[OutputRow]            outputs (server.worker_protocol.wire.OutputRow)
    running() -> int, waiting() -> int

and optionally::

    notes: list                             [rid, dict] details (such as cached_tokens) the
                                            loop sends with the next STEP, then clears
    close() -> None                         called once when the worker ends
    tokenize(request) -> dict               /tokenize and /detokenize (wire.CALL)
    engine_stats() -> dict | None           the engine's own statistics, sent with each PONG
                                            (wire.ENGINE_STATS: the vllm engine's KV-cache
                                            usage, preemptions, tokens per step)
    wakeup_fd() -> int | None               a descriptor that turns readable when step()
                                            has work (an engine whose model runs in another
                                            process: vLLM's engine core); the loop waits on
                                            it beside its pipe
    faults: bool                            True: it takes the ``fault`` test hook (the sim
                                            engine with --sim-faults); a request carrying
                                            one to any other engine is refused by the loop
                                            (:func:`refuse_fault`)

``prompt`` is a string, a list of token ids, or ``{"messages": [...]}`` for chat. ``step`` may
take as long as the engine's real work takes: the loop reads the pipe between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Protocol

from ..params import context_error, truncated
from ..worker_protocol import wire

__all__ = [
    "Engine", "EngineBroken", "HFTokenizing", "Rejected", "WorkerCrash", "WorkerGarbage",
    "WorkerHang",
    "TRUNCATION_FIELDS", "check_context", "encode_prompt", "encode_text", "finite_logprob",
    "malformed", "one_line", "prompt_param", "refuse_fault", "tokenize_request", "truncate_prompt",
    "MAX_LOGPROBS",
]


class Rejected(Exception):
    """The request cannot be served; ``kind`` is a wire error kind (see server.errors),
    ``param`` the client's field at fault when the refusal concerns one (the body's name
    for it: ``max_tokens``, ``messages``, ``response_format``...), else None."""

    def __init__(self, message: str, kind: str = "invalid_request",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    def err(self, request: object) -> list:
        """The wire ``err`` answering ``request`` (its SUBMIT params or CALL request):
        with ``param`` only when the request asks (:func:`wire.error`)."""
        return wire.error(self.kind, self.message, self.param, request)


class EngineBroken(Exception):
    """The engine failed in a way it cannot be trusted to recover from (its library's
    state after the failure is unknown). ``outputs`` end every request it held with an
    error; the worker sends them, then exits, and the frontend starts a fresh worker."""

    def __init__(self, message: str, outputs: list) -> None:
        super().__init__(message)
        self.message = message
        self.outputs = outputs


class WorkerCrash(BaseException):
    """Fault injection: the worker process must die at once, as if it had segfaulted."""


class WorkerHang(BaseException):
    """Fault injection: the worker process must stop answering, but stay alive."""


class WorkerGarbage(BaseException):
    """Fault injection: the worker process writes bytes that are not a frame, then idles."""


class Engine(Protocol):
    info: dict

    def add(self, rid: int, prompt: object, params: dict) -> int: ...
    def abort(self, rid: int) -> bool: ...
    def next_deadline(self) -> float | None: ...
    def step(self, now: float) -> list[list]: ...
    def running(self) -> int: ...
    def waiting(self) -> int: ...


#: The fields :func:`truncate_prompt` honours (every generation engine's HELLO lists them).
TRUNCATION_FIELDS = ("truncate_prompt_tokens", "truncation_side")


def truncate_prompt(ids, params: dict, max_model_len: int):
    """vLLM's ``truncate_prompt_tokens: k`` with ``truncation_side``: a prompt of more than
    ``k`` tokens keeps its last ``k`` (``"left"``, vLLM's default for generation) or its
    first (``"right"``); ``-1`` is the context less one token for the output; ``k`` past
    the context is refused in vLLM's words. Applied after tokenizing and templating, before
    the context check (so that a long prompt asked to be cut is served)."""
    k = params.get("truncate_prompt_tokens")
    if k is not None and k > max_model_len:
        raise Rejected(f"truncate_prompt_tokens={k} cannot be greater than max_total_tokens = "
                       f"{max_model_len}. Please request a smaller truncation size.",
                       param="truncate_prompt_tokens")
    return truncated(ids, params, max_model_len)


def malformed(field: str) -> Rejected:
    """The refusal of a wire parameter ``field`` of the wrong type or out of range (the
    frontend checks each first: this is a worker not trusting its peer), naming it."""
    return Rejected(f"malformed sampling parameter {field!r}", param=field)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling fields every generation engine reads from a request's wire params, as
    :func:`read_sampling` checked them: ``max_tokens`` (``None``: what fits the context),
    ``temperature``, ``top_p``, ``seed`` (``None``: unseeded) and the non-empty ``stop``
    strings."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]


def read_sampling(params: dict) -> Sampling:
    """Read and check a request's sampling fields (a worker does not trust its peer: the
    frontend checked them first). A malformed or out-of-range field is :class:`Rejected`,
    naming it. The sim and the transformers engine read them here, so both read them alike."""
    field = "max_tokens"  # (the one being read: a malformed one is refused by name)
    try:
        max_tokens = params.get("max_tokens", 16)
        max_tokens = None if max_tokens is None else int(max_tokens)
        field = "temperature"
        temperature = float(params.get("temperature", 1.0))
        field = "top_p"
        top_p = float(params.get("top_p", 1.0))
        field = "seed"
        seed = params.get("seed")
        seed = None if seed is None else int(seed)
        field = "stop"
        stop = tuple(s for s in params.get("stop") or () if s)
    except (TypeError, ValueError):
        raise malformed(field) from None
    if max_tokens is not None and max_tokens < 1:
        raise Rejected("max_tokens must be at least 1", param="max_tokens")
    if temperature < 0:
        raise Rejected("temperature must be >= 0", param="temperature")
    if not 0 < top_p <= 1:
        raise Rejected("top_p must be in (0, 1]", param="top_p")
    return Sampling(max_tokens, temperature, top_p, seed, stop)


def prompt_param(prompt: object) -> str:
    """The client's field a wire prompt came from, for a refusal of it: chat's
    ``messages`` (``{"messages": [...]}``; OpenAI's context_length_exceeded names it so),
    else ``prompt`` (/v1/completions, /tokenize). The frontend renames it for an endpoint
    that calls it otherwise (/v1/responses: ``input``)."""
    return "messages" if isinstance(prompt, dict) else "prompt"


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  param: str = "prompt") -> int:
    """Reject a request that cannot fit the model's context, with OpenAI's wording,
    naming ``param`` (the prompt's field, :func:`prompt_param`).

    Returns the effective max_tokens: ``None`` (no limit asked) means what fits.
    """
    if prompt_tokens < 1:
        raise Rejected("The prompt must contain at least one token.", param=param)
    error = context_error(prompt_tokens, max_tokens, max_model_len)
    if error is not None:
        raise Rejected(error, param=param)
    return max_model_len - prompt_tokens if max_tokens is None else max_tokens


def refuse_fault(engine, fault: object) -> None:
    """Raise :class:`Rejected` naming ``fault`` when a request carries one (not None) and
    ``engine`` does not take it (its ``faults`` is false: only the sim engine started with
    --sim-faults has it true, and honours one). Fault injection is a test hook: a real
    engine, or a sim without it, must neither ignore one nor be handed one."""
    if fault is None or getattr(engine, "faults", False):
        return
    name = engine.info.get("engine", "this")
    raise Rejected(f"'fault' is a test hook of the sim engine started with --sim-faults; "
                   f"this worker's {name} engine does not take it", param="fault")


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters (for an operator's
    log line or an error body: never a traceback)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``, the same ids, through the
    ``tokenizers`` library's ``encode_batch`` when ``tokenizer`` is a transformers fast
    tokenizer whose backend is set as transformers' ``encode`` would set it.

    Why: transformers' ``encode`` calls the same Rust ``encode_batch`` (which releases the
    GIL), then builds its ids, attention mask and token type ids as Python lists, holding
    the GIL 0.3 s for a 3.5 MB prompt, which stops the worker's step loop; here only the
    ids' list is built (0.09 s). Not the backend's ``encode``: it holds the GIL for the
    whole tokenization (13 s for that prompt). Anything else (no backend, truncation or
    padding set on it, a ``split_special_tokens`` that differs) goes through ``encode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and type(backend).__module__.startswith("tokenizers")
            and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens",
                                                              False))):
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_prompt(
    prompt: object,
    tokenizer,
    *,
    vocab_size: int,
    chat: bool,
    model: str,
    template_kwargs: dict | None = None,
    tools: list | None = None,
    fits=None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a prompt (a string, token ids, or ``{"messages": [...]}``) with a Hugging
    Face tokenizer: chat messages through its chat template (``chat``: whether it has one),
    as vLLM and transformers render them, with the request's ``chat_template_kwargs`` (such
    as ``enable_thinking``) as template variables and its ``tools`` (OpenAI's shape) as the
    template's ``tools``. ``fits(text)``, when given, may refuse a text before it is
    tokenized (see :meth:`HFTokenizing.fits`). ``add_special_tokens``: the tokenizer's own
    (a BOS) are added to a rendered chat too (vLLM's /tokenize option; generation renders
    without them, as vLLM). Client faults raise :class:`Rejected` naming the prompt's
    field (:func:`prompt_param`)."""
    if isinstance(prompt, str):
        if fits is not None:
            fits(prompt, "prompt")
        return encode_text(tokenizer, prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:  # (vLLM's words: "out of vocabulary")
            raise Rejected(f"token id {bad} is out of vocabulary (this model's token ids are "
                           f"0 to {vocab_size - 1})", param="prompt")
        return list(prompt)
    if isinstance(prompt, dict):
        messages = prompt.get("messages")
        if not isinstance(messages, list):
            raise Rejected("messages must be a list", param="messages")
        if not chat:
            raise Rejected(
                f"model {model!r} has no chat template, so it cannot serve chat completions; "
                "use /v1/completions with a prompt", param="messages"
            )
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=prompt.get("add_generation_prompt", True) is not False,
                continue_final_message=prompt.get("continue_final_message") is True,
                **(template_kwargs or {}),
            )
        except Exception as exc:
            raise Rejected(f"cannot render the chat template: {one_line(exc)}",
                           param="messages") from None
        if fits is not None:
            fits(text, "messages")
        return encode_text(tokenizer, text, add_special_tokens=add_special_tokens)
    raise Rejected("prompt must be a string or a list of token ids", param="prompt")


def tokenize_request(
    request: dict, tokenizer, *, vocab_size: int, chat: bool, model: str, max_model_len: int
) -> dict:
    """Answer a CALL request (see server.worker_protocol.wire) with a Hugging Face tokenizer:
    ``{"tokens", "max_model_len"}`` for ``tokenize`` (chat messages rendered as for
    generation; the tokens packed, :func:`wire.pack_ids`, when the frontend asks with
    ``"packed_ids": true``), ``{"prompt"}`` for ``detokenize``, the tokenizer's configuration for
    ``info`` (see :func:`tokenizer_info`)."""
    op = request.get("op")
    if op == "info":
        return tokenizer_info(tokenizer)
    if op == "detokenize":
        ids = request.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise Rejected("tokens must be a list of token ids", param="tokens")
        if any(not 0 <= t < vocab_size for t in ids):
            raise Rejected(f"token ids must be between 0 and {vocab_size - 1}", param="tokens")
        return {"prompt": tokenizer.decode(ids)}
    if op != "tokenize":
        raise Rejected(f"unknown tokenize operation {op!r}")
    packed = request.get(wire.PACKED_IDS_KEY, False)
    if type(packed) is not bool:
        raise Rejected(f"{wire.PACKED_IDS_KEY} must be a boolean")
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        special = bool(request.get("add_special_tokens", True))
        ids = encode_text(tokenizer, prompt, add_special_tokens=special)
    else:
        tools = request.get("tools")
        template_kwargs = request.get("template_kwargs")
        if (tools is not None and not isinstance(tools, list)) or (
                template_kwargs is not None and not isinstance(template_kwargs, dict)):
            raise Rejected("tools must be a list and template_kwargs an object",
                           param="tools" if isinstance(template_kwargs, dict) or
                           template_kwargs is None else "chat_template_kwargs")
        ids = encode_prompt(prompt, tokenizer, vocab_size=vocab_size, chat=chat, model=model,
                            template_kwargs=template_kwargs, tools=tools,
                            add_special_tokens=request.get("add_special_tokens") is True)
    result: dict = {"tokens": wire.pack_ids(ids) if packed else ids,
                    "max_model_len": max_model_len}
    if request.get("token_strs"):  # vLLM's return_token_strs: the vocabulary's strings
        result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return result


def tokenizer_info(tokenizer) -> dict:
    """``GET /tokenizer_info`` as vLLM answers it: the tokenizer's configuration (its
    ``tokenizer_config.json`` as loaded: special tokens, ``chat_template``, ...) without
    file paths, its ``tokenizer_class``. Plain JSON values: a special token as its text,
    keys as strings, anything else as its ``str``."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for name in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(name, None)
    config = _plain(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def _plain(value):
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)


class HFTokenizing:
    """Prompt encoding and /tokenize for the engines that serve with a Hugging Face
    tokenizer (transformers, vllm): they set ``tokenizer``, ``vocab_size``,
    ``chat_template``, ``info`` and ``max_model_len``."""

    tokenizer: Any  # a Hugging Face tokenizer (an optional dependency)
    vocab_size: int
    chat_template: str | None
    info: dict
    max_model_len: int
    #: The UTF-8 length of the vocabulary's longest token string (added tokens included).
    _longest_token: int | None = None

    def tokenize(self, request: dict) -> dict:
        """/tokenize and /detokenize, with the tokenizer requests are served with."""
        return tokenize_request(
            request, self.tokenizer, vocab_size=self.vocab_size,
            chat=self.chat_template is not None, model=self.info["model"],
            max_model_len=self.max_model_len,
        )

    def encode(
        self, prompt: object, template_kwargs: dict | None = None, tools: list | None = None
    ) -> list[int]:
        """Token ids of a prompt (a string, token ids, or ``{"messages": [...]}``), with
        the request's template variables and tools."""
        return encode_prompt(
            prompt, self.tokenizer, vocab_size=self.vocab_size,
            chat=self.chat_template is not None, model=self.info["model"],
            template_kwargs=template_kwargs, tools=tools, fits=self.fits,
        )

    def fits(self, text: str, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, a prompt text that cannot fit the context: one of
        more UTF-8 bytes than ``max_model_len`` tokens of the vocabulary's longest token
        can hold (a token's string in the vocabulary is at least as long as its text, for
        byte-level BPE, SentencePiece and byte fallback alike; a normalizer that deletes
        text, as BERT's, would break that). Tokenizing megabytes costs seconds of CPU and
        hundreds of MB; this costs nothing."""
        if self._longest_token is None:  # once (any preparation thread may compute it)
            vocab = self.tokenizer.get_vocab()
            self._longest_token = max((len(t.encode()) for t in vocab), default=1)
        limit = self.max_model_len * self._longest_token
        if len(text) * 4 <= limit:  # at most 4 bytes a character: it fits
            return
        size = len(text.encode())
        if size > limit:
            raise Rejected(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {size} bytes of text, more than "
                f"{self.max_model_len} tokens can hold. Please reduce the length of the prompt.",
                param=param)


#: The most alternatives per token a request may ask for (OpenAI: 5 for completions, 20 for
#: chat; vLLM's default max_logprobs: 20). An engine that makes logprobs says so in its HELLO
#: (``"logprobs": MAX_LOGPROBS``).
MAX_LOGPROBS = 20


def finite_logprob(value: float) -> float:
    """JSON has no -inf: a token the model rules out gets vLLM's -9999.0."""
    return value if value > -9999.0 else -9999.0
