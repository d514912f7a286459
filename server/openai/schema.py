"""Parsing and validating OpenAI request bodies. Sans-IO: bytes in, a request or a ClientError out.

Everything a client can get wrong is decided here, before a response starts, so that it is
answered with a 400 (or 404 for an unknown model) and never surfaces as a broken stream.
Fields with a meaning the server does not honour (penalties, logprobs, tools, response
formats, ...) are refused with a 400 naming them (:mod:`server.openai.fields`); fields nobody
defines are ignored, as OpenAI clients send extras.

Example::

    req = parse_completion(b'{"model": "sim", "prompt": "hi", "max_tokens": 4}', limits)
    req.prompts, req.params.max_tokens   # (["hi"], 4)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from ..config import Limits
from ..errors import ClientError, NotFound, clip, printable
from ..params import MAX_TOKEN_ID, SamplingParams, context_error, is_token_ids
from .json_schema import check_grammar_ints, check_refs
from .images import ImageRef, image_limit, read_image_url_part, refuse_image
from .fields import (
    HONOURED_CHAT, HONOURED_COMPLETION, KNOWN, UNSUPPORTED, check_fields, is_neutral,
)
from .structured import structural_tag, structured_outputs
from .tools import TOOL_FIELDS, ToolChoice, calls_or_document, history_message, read_tools

__all__ = [
    "GenerateRequest", "chat_request", "decode_json", "messages_of", "parse_chat", "parse_completion",
    "template_options",
]

_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class GenerateRequest:
    """A validated completions or chat request."""

    chat: bool
    model: str | None
    prompts: list  # each: str, list[int], or {"messages": [...]}
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    user: str | None
    #: Alternatives per token asked for (0: the chosen token's logprob only); None: no
    #: logprobs. With ``echo`` (completions), the prompt's logprobs too.
    logprobs: int | None = None
    #: ``stream_options.continuous_usage_stats``: usage on every chunk (vLLM).
    continuous_usage: bool = False
    #: Tools, when the request has some (server.openai.tools).
    tools: ToolChoice | None = None
    #: With ``echo``, each prompt's text: a text prompt itself; a token-id prompt's None
    #: until the frontend has it detokenized (:func:`server.http.generate.echo_texts`).
    echoed: tuple = ()
    #: vLLM's ``request_id``: the response id's base when the client sent no ``X-Request-Id``.
    request_id: str | None = None
    #: vLLM's chat ``include_reasoning``: false drops what --reasoning-parser splits off as
    #: reasoning (the answer's content stays as it is).
    include_reasoning: bool = True
    #: vLLM's ``return_token_ids``: the prompt's ids and each choice's token ids go out
    #: (the worker sends them only then: the params' ``token_ids`` and ``prompt_token_ids``).
    return_token_ids: bool = False
    #: vLLM's ``prompt_logprobs``: the prompt's logprobs in vLLM's shape go out (a
    #: completion choice's ``prompt_logprobs``, a chat answer's); None: not asked.
    prompt_logprobs: int | None = None
    #: vLLM's ``return_tokens_as_token_ids``: logprobs' tokens spelled ``token_id:N``.
    tokens_as_ids: bool = False
    #: Chat: whether the model thinks, as vLLM's qwen3 reasoning parser reads it
    #: (``chat_template_kwargs.enable_thinking``, default true).
    thinking: bool = True


def decode_json(body: bytes, known: bool = False) -> dict:
    """The body as a JSON object, or a ClientError that says what is wrong with it.

    ``known``: a body of :data:`SKIP_UNKNOWN_FROM` bytes or more keeps only the fields of
    :data:`~server.openai.fields.KNOWN`: msgspec skips the others without building them (a
    body of 350k keys nobody defines: 25 ms instead of 170-220 ms of the loop's time), and
    they are not logged.

    msgspec parses (4-16 times as fast as the standard library, which matters because the
    parse holds the GIL, and with it the event loop, for its whole length: a 4 MB body of
    token ids took 0.4 s with ``json.loads`` and a ``parse_int`` hook, 26 ms with msgspec).
    What msgspec refuses is parsed again by the standard library, which says what is wrong
    in its words, takes what it takes (``NaN``, ``1e400``: then refused by the field that
    has them), and whose result is walked for lone surrogates (msgspec only says
    "truncated"), so the answers are those of ``json.loads``, faster."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError("The request body is not valid UTF-8.") from None
    try:
        if known and len(body) >= SKIP_UNKNOWN_FROM:
            fields = _decode_known(body)
            data = {name: value for name in _KNOWN_NAMES
                    if (value := getattr(fields, name)) is not msgspec.UNSET}
        else:
            data = _msgspec_decode(body)
    except RecursionError:
        raise ClientError("The request body is nested too deeply.") from None
    except msgspec.DecodeError:
        data = _stdlib_decode(text)
    if not isinstance(data, dict):
        raise ClientError("The request body must be a JSON object.")
    return data


_msgspec_decode = msgspec.json.Decoder().decode
#: Bodies at least this large are parsed skipping the fields nobody defines (``known``).
SKIP_UNKNOWN_FROM = 256 * 1024
_KNOWN_NAMES = tuple(sorted(KNOWN | TOOL_FIELDS))
_decode_known = msgspec.json.Decoder(msgspec.defstruct(
    "KnownFields", [(name, Any, msgspec.UNSET) for name in _KNOWN_NAMES]
)).decode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _stdlib_decode(text: str):
    """The standard library's parse of a body msgspec refused."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ClientError("The request body is nested too deeply.") from None
    except ValueError as exc:
        if "int_max_str_digits" in str(exc):  # (a number of more than 4300 digits)
            raise ClientError("The request body is not valid JSON: a number has too many "
                              "digits.") from None
        raise ClientError(f"The request body is not valid JSON: {exc}.") from None
    if _SURROGATE_ESCAPE.search(text) is not None:
        _check_unicode(data, "")
    return data


def _check_unicode(value, where: str) -> None:
    """Refuse a lone surrogate (a ``\\ud800`` escape without its pair) anywhere in the body,
    keys and fields we do not read included: such a string is not Unicode text, and would
    break whatever logs or forwards it. Only walked when the body has such an escape."""
    if isinstance(value, str):
        _utf8(value, where or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            _utf8(key, where or None)
            _check_unicode(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


def _utf8(text: str, param: str | None) -> str:
    """``text``, unless it holds a lone surrogate (a JSON ``\\ud800`` escape): such a string
    is not Unicode text and cannot reach the engine."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ClientError("Strings must be valid Unicode (no lone surrogates).", param=param) from None
    return text


def _int(data: dict, name: str, default, lo: int, hi: int):
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
            return int(value)
        raise ClientError(f"'{name}' must be an integer.", param=name)
    if not lo <= value <= hi:
        # pydantic's words too, which vLLM answers with (clients and vLLM's tests match them)
        kind, bound = ("greater", lo) if value < lo else ("less", hi)
        raise ClientError(f"'{name}' must be between {lo} and {hi}, got {clip(str(value))}: "
                          f"Input should be {kind} than or equal to {bound} "
                          f"[type={kind}_than_equal].", param=name)
    return value


def _number(data: dict, name: str, default, lo: float, hi: float, lo_open=False):
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClientError(f"'{name}' must be a number.", param=name)
    value = float(value)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        bound = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise ClientError(f"'{name}' must be {bound} and at most {hi}.", param=name)
    return value


def _bool(data: dict, name: str, default):
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ClientError(f"'{name}' must be a boolean.", param=name)
    return value


def _stop(data: dict, limits: Limits) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ClientError("'stop' must be a string or a list of strings.", param="stop")
    if len(stop) > limits.max_stop:
        raise ClientError(f"'stop' may hold at most {limits.max_stop} strings.", param="stop")
    return tuple(_utf8(s, "stop") for s in stop if s)


def _fits(prompt: list, max_tokens: int | None, max_model_len: int | None) -> list:
    """``prompt`` (a list), refused with the worker's own 400 when as token ids it could
    not fit the context: checked on its length, before the walk over its items, so that a
    body of millions of token ids costs the parse and no more, and never reaches a worker."""
    if max_model_len and prompt and isinstance(prompt[0], int):
        error = context_error(len(prompt), max_tokens, max_model_len)
        if error is not None:
            raise ClientError(error, param="prompt")  # (as the worker names it)
    return prompt


def _prompts(
    data: dict, limits: Limits, max_tokens: int | None = None, max_model_len: int | None = None
) -> list:
    """The prompts of a completions request (``max_model_len``: the engine's, when it says;
    a token-id prompt that cannot fit it is refused here, see :func:`_fits`)."""
    if "prompt" not in data:
        raise ClientError("'prompt' is required.", param="prompt")
    prompt = data["prompt"]
    error = ClientError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids.",
        param="prompt",
    )
    prompts: list
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif is_token_ids(_fits(prompt, max_tokens, max_model_len)):
            prompts = [prompt]
        elif all(
            isinstance(p, list) and p and is_token_ids(_fits(p, max_tokens, max_model_len))
            for p in prompt
        ):
            prompts = list(prompt)
        else:
            raise error
    else:
        raise error
    if len(prompts) > limits.max_prompts:
        raise ClientError(
            f"At most {limits.max_prompts} prompts per request.", param="prompt"
        )
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise ClientError("'prompt' must not be empty.", param="prompt")
            _utf8(p, "prompt")
    return prompts


_PART_KINDS = {"image_url": "image", "input_audio": "audio", "file": "file", "image": "image"}


def _content(content, index: int, images: int, model: object) -> str | list:
    """A message's content: a string, or (when it holds images: ``images`` > 0, the
    engine's per-prompt limit) its parts in order, text parts as ``{"type": "text",
    "text": ...}`` and images as :class:`~server.openai.images.ImageRef`. ``model`` is
    named when an image is refused."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list = []
        refs = False
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and images:
                parts.append(read_image_url_part(part, f"{param}[{j}]"))
                refs = True
                continue
            if isinstance(kind, str) and kind in _PART_KINDS:  # (a list is not hashable)
                if _PART_KINDS[kind] == "image" and images:  # (a vision model: the shape)
                    raise ClientError(f"Content parts of type '{kind}' are not supported; "
                                      "send an image as an 'image_url' part.",
                                      param=f"{param}[{j}]")
                if _PART_KINDS[kind] == "image" and model is not None:
                    raise refuse_image(kind, f"{param}[{j}]", model)
                raise ClientError(
                    f"Content parts of type '{kind}' are not supported: the engine takes text "
                    f"only (no {_PART_KINDS[kind]} input).",
                    param=f"{param}[{j}]",
                )
            if kind != "text":
                raise ClientError("Only text content parts are supported.", param=f"{param}[{j}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise ClientError("A text content part needs a string 'text'.", param=f"{param}[{j}]")
            parts.append(text)
        if not refs:
            return "".join(parts)
        return [p if isinstance(p, ImageRef) else {"type": "text", "text": _utf8(p, param)}
                for p in parts]
    raise ClientError("'content' must be a string or a list of parts.", param=param)


def messages_of(data: dict, tools_ok: bool = False, engine_info: dict | None = None) -> list:
    """OpenAI's rules: a known role (or a custom one, which the chat template gets as it
    is, as in vLLM); ``content`` required for system, developer, user, tool and custom
    messages; a tool message needs ``tool_call_id``; an assistant message may carry
    ``tool_calls`` instead of content. Tool calls and tool results in the history are
    refused unless the engine renders tools (``tools_ok``: they would otherwise be
    dropped). Image parts of user messages are kept (as refs the route fetches) when
    ``engine_info`` says the engine takes images, at most its per-prompt limit; a 400
    naming the part and the model otherwise (server.openai.images). Without
    ``engine_info`` (a route that fetches nothing) every image part is refused."""
    images = image_limit(engine_info)
    model = None
    if engine_info is not None:
        model = data.get("model") if isinstance(data.get("model"), str) else \
            engine_info.get("model")
    seen = 0
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("'messages' must be a non-empty list.", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ClientError("Each message must be an object.", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES and not (
            isinstance(role, str) and 0 < len(role) <= 64 and role.isprintable()
        ):  # a custom role goes to the chat template as it is, as vLLM passes it
            raise ClientError(
                f"'role' must be one of {', '.join(_ROLES)}, or a custom role's name (1 to 64 "
                "printable characters).", param=f"messages[{i}].role"
            )
        content = m.get("content")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ClientError(
                "A tool message needs a string 'tool_call_id'.", param=f"messages[{i}].tool_call_id"
            )
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and not calls:
            raise ClientError(
                f"A {role} message needs 'content'.", param=f"messages[{i}].content"
            )
        text = "" if content is None else _content(content, i, images, model)
        if isinstance(text, str):
            text = _utf8(text, f"messages[{i}].content")
        else:
            seen = _check_images(text, role, seen, images)
        rendered.append(history_message(m, i, role, text, tools_ok))
        name = m.get("name")
        if name is not None:  # the participant's name, for the template (as vLLM passes it)
            if not isinstance(name, str):
                raise ClientError("'name' must be a string.", param=f"messages[{i}].name")
            rendered[-1]["name"] = _utf8(name, f"messages[{i}].name")
    return rendered


def _check_images(parts: list, role: str, seen: int, limit: int) -> int:
    """The images seen so far with this message's ``parts``; a 400 naming an image part
    of a message other than a user's, or the first past the per-prompt ``limit``."""
    for part in parts:
        if isinstance(part, ImageRef):
            if role != "user":
                raise ClientError(f"Image parts are taken in user messages only, not in a "
                                  f"{printable(role)} message.", param=part.param)
            seen += 1
            if seen > limit:
                raise ClientError(f"This model takes at most {limit} image(s) per prompt "
                                  "(--limit-mm-per-prompt).", param=part.param,
                                  code="too_many_images")
    return seen


def _token_id_list(data: dict, name: str, most: int) -> list[int] | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > most or not is_token_ids(value):
        raise ClientError(f"'{name}' must be a list of at most {most} token ids.", param=name)
    return value


def _logit_bias(data: dict) -> dict[str, float] | None:
    value = data.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 300:
        raise ClientError(
            "'logit_bias' must be an object of at most 300 token ids to numbers.",
            param="logit_bias",
        )
    bad = [key for key in value
           if not (key.isascii() and key.isdigit() and len(key) < 11 and int(key) <= MAX_TOKEN_ID)]
    if bad:
        named = ", ".join(repr(clip(key)) for key in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise ClientError(
            f"'logit_bias' keys must be token ids, not {named}{more}.", param="logit_bias"
        )
    out = {}
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
            -100 <= bias <= 100
        ):
            raise ClientError(
                "'logit_bias' values must be numbers from -100 to 100.", param="logit_bias"
            )
        out[key] = float(bias)
    return out


def _response_format(data: dict) -> dict | None:
    """``response_format`` for the engine: ``{"type": "json_object"}``, ``{"type":
    "json_schema", "schema": {...}}``, a structural tag (vLLM's, :func:`structural_tag`), or
    None (``text``, the default)."""
    value = data.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise ClientError(
            "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"}, "
            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} or "
            "a structural tag ({\"type\": \"structural_tag\", ...}, vLLM's).",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "structural_tag":
        return structural_tag(value, "response_format")
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ClientError(
            "'response_format.json_schema' must be an object with a 'schema' object.",
            param="response_format",
        )
    if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), bool):
        raise ClientError(
            "'response_format.json_schema' needs a string 'name' and a boolean 'strict'.",
            param="response_format",
        )
    check_refs(spec["schema"], "response_format")
    check_grammar_ints(spec["schema"], "response_format")
    return {"type": "json_schema", "schema": spec["schema"]}


#: Template variables a request may not set: the server decides them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "tools", "documents", "return_dict", "return_assistant_tokens_mask",
})


def template_kwargs_of(data: dict) -> dict | None:
    """``chat_template_kwargs``, validated (None: none given)."""
    value = data.get("chat_template_kwargs")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ClientError("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    reserved = sorted(set(value) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ClientError(
            f"'chat_template_kwargs' may not set {', '.join(reserved)}.",
            param="chat_template_kwargs",
        )
    return value


#: Engine-honoured sampling fields (fields.UNSUPPORTED names an engine may declare), each
#: with its validation; vLLM's ranges.
_ENGINE_SAMPLING = {
    "top_k": lambda d, lim: _int(d, "top_k", None, -1, 2**31 - 1),
    "min_p": lambda d, lim: _number(d, "min_p", None, 0.0, 1.0),
    "presence_penalty": lambda d, lim: _number(d, "presence_penalty", None, -2.0, 2.0),
    "frequency_penalty": lambda d, lim: _number(d, "frequency_penalty", None, -2.0, 2.0),
    "repetition_penalty": lambda d, lim: _number(
        d, "repetition_penalty", None, 0.0, 10.0, lo_open=True
    ),
    "min_tokens": lambda d, lim: _int(d, "min_tokens", None, 0, lim.max_tokens),
    "stop_token_ids": lambda d, lim: _token_id_list(d, "stop_token_ids", 64),
    "logit_bias": lambda d, lim: _logit_bias(d),
    "include_stop_str_in_output": lambda d, lim: _bool(d, "include_stop_str_in_output", None),
    "skip_special_tokens": lambda d, lim: _bool(d, "skip_special_tokens", None),
    "spaces_between_special_tokens": lambda d, lim: _bool(
        d, "spaces_between_special_tokens", None
    ),
    "response_format": lambda d, lim: _response_format(d),
    "structured_outputs": lambda d, lim: structured_outputs(d),
    "chat_template_kwargs": lambda d, lim: template_kwargs_of(d),
    "allowed_token_ids": lambda d, lim: _allowed_token_ids(d),
    "bad_words": lambda d, lim: _strings(d, "bad_words", 64, 256),
    "cache_salt": lambda d, lim: _cache_salt(d),
    "priority": lambda d, lim: _int(d, "priority", None, -(2**63), 2**63 - 1),
    "return_token_ids": lambda d, lim: _bool(d, "return_token_ids", None),
    "return_tokens_as_token_ids": lambda d, lim: _bool(d, "return_tokens_as_token_ids", None),
    "truncate_prompt_tokens": lambda d, lim: _int(d, "truncate_prompt_tokens", None, -1,
                                                  2**63 - 1),
    "truncation_side": lambda d, lim: _choice(d, "truncation_side", ("left", "right")),
}


def _choice(data: dict, name: str, values: tuple):
    """One of ``values`` (a string), or None when not given."""
    value = data.get(name)
    if value is not None and value not in values:
        raise ClientError(f"'{name}' must be one of: {', '.join(map(repr, values))}.",
                          param=name)
    return value


def _prompt_logprobs(data: dict, engine_info: dict | None) -> int | None:
    """vLLM's ``prompt_logprobs``: the prompt's logprobs (each token's, and its ``k`` most
    likely alternatives), in a whole answer only (vLLM's rule, and its words); ``k`` as
    ``logprobs`` takes it (-1: the whole vocabulary, where the engine's most covers it).
    Streamed, vLLM takes 0 (its own check refuses only more, or -1): its chunks have no
    place for them, so none go out, but 0 still says how many alternatives a completion's
    echoed prompt carries with ``echo`` and ``logprobs``, as here."""
    top = _top_logprobs(data, "prompt_logprobs", engine_info)
    if top is None:
        return None
    if data.get("stream") and top != 0:
        raise ClientError("`prompt_logprobs` are not available when `stream=True`.",
                          param="prompt_logprobs")
    return _most_logprobs(top, "prompt_logprobs", engine_info)


def _allowed_token_ids(data: dict) -> list[int] | None:
    ids = _token_id_list(data, "allowed_token_ids", 1 << 18)
    if ids == []:
        raise ClientError("'allowed_token_ids' may not be empty.", param="allowed_token_ids")
    return ids


def _strings(data: dict, name: str, most: int, longest: int) -> list[str] | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > most or not all(
        isinstance(s, str) and 0 < len(s) <= longest for s in value
    ):
        raise ClientError(f"'{name}' must be a list of at most {most} non-empty strings of at "
                          f"most {longest} characters.", param=name)
    for s in value:
        _utf8(s, name)
    return value


def _cache_salt(data: dict) -> str | None:
    value = data.get("cache_salt")
    if value is not None and (not isinstance(value, str) or not value):
        raise ClientError("'cache_salt' must be a non-empty string.", param="cache_salt")
    return value if value is None else _utf8(value, "cache_salt")


def _engine_sampling(data: dict, limits: Limits, engine_fields: frozenset) -> dict:
    """The engine-honoured sampling fields of a request, validated (None values dropped)."""
    out = {}
    for name in engine_fields:
        # (top_logprobs: read by _logprobs; tools: by server.openai.tools)
        if (name in data and name not in ("top_logprobs", "prompt_logprobs")
                and name not in TOOL_FIELDS and name not in TEMPLATE_OPTIONS):
            check = _ENGINE_SAMPLING.get(name)
            if check is None:  # an engine declared a field this server cannot validate
                raise ClientError(f"'{name}' is not supported by this server.", param=name)
            value = check(data, limits)
            if value is not None:
                out[name] = value
    constraint = out.pop("structured_outputs", None)
    if constraint is not None:  # vLLM's spelling of response_format (server.openai.structured)
        if "response_format" in out:
            raise ClientError("'structured_outputs' and 'response_format' may not both be "
                              "given: choose one.", param="structured_outputs")
        out["response_format"] = constraint
    return out


def _logprobs(data: dict, chat: bool, engine_info: dict | None) -> int | None:
    """How many alternatives per token a request asks for (None: no logprobs): completions'
    ``logprobs: k``, chat's ``logprobs: true`` with ``top_logprobs: k``; as
    :func:`_most_logprobs` has them. Refused (400) when the engine does not say it makes
    them."""
    name = "top_logprobs" if chat else "logprobs"
    if chat:
        asked = _bool(data, "logprobs", False)
        top = _top_logprobs(data, name, engine_info)
        if not asked:
            if top:
                raise ClientError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
            return None
        top = top or 0
    else:
        if data.get("logprobs") is False:
            return None
        top = _top_logprobs(data, name, engine_info)
        if top is None:
            return None
    return _most_logprobs(top, name, engine_info)


def _top_logprobs(data: dict, name: str, engine_info: dict | None) -> int | None:
    """``data[name]``, alternatives per token, in range: 0 to the engine's most (its HELLO's
    ``logprobs``, the vllm engine's ``--max-logprobs``), or -1 (None: not given)."""
    most = (engine_info or {}).get("logprobs")
    if data.get(name) == -1 and not isinstance(data.get(name), bool):
        return -1
    return _int(data, name, None, 0, most if isinstance(most, int) else 20)


def _most_logprobs(top: int, name: str, engine_info: dict | None) -> int:
    """``top`` alternatives per token as the engine makes them: -1, the whole vocabulary
    (vLLM's meaning), is its size, when the engine's most covers it. Refused (400) when the
    engine does not say it makes logprobs."""
    info = engine_info or {}
    most = info.get("logprobs")
    if not isinstance(most, int):
        engine = info.get("engine")
        by = f"the {engine} engine" if engine else "this server"
        raise ClientError(f"'logprobs' is not supported by {by}.", param="logprobs",
                          code="unsupported_parameter")
    if top == -1:
        vocab = info.get("vocab_size")
        if not isinstance(vocab, int) or vocab > most:
            raise ClientError(
                f"'{name}': -1 (the whole vocabulary"
                f"{f', {vocab} tokens' if isinstance(vocab, int) else ''}) is more than the "
                f"{most} the server gives (the vllm engine's --max-logprobs).", param=name)
        return vocab
    return top


#: What ``request_id`` may be: as an ``X-Request-Id`` (server.observability.logs).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _check_stream_options(options: dict) -> None:
    """A 400 naming every key of ``stream_options`` the server does not honour
    (``include_obfuscation`` only as false: the chunks carry no obfuscation padding)."""
    honoured = ("include_usage", "continuous_usage_stats")
    neutral = {"include_obfuscation": (None, False)}
    bad = [k for k in options if k not in honoured
           and not is_neutral(options[k], neutral.get(k, ()))]
    if bad:
        names = ", ".join(f"'stream_options.{printable(k, 64)}'" for k in bad)
        raise ClientError(f"{names}: not supported by this server.", param="stream_options",
                          code="unsupported_parameter")


def _common(
    data: dict,
    limits: Limits,
    served_model: str | None,
    *,
    chat: bool,
    engine_fields: frozenset,
    engine_info: dict | None,
) -> dict:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string.", param="model")
    if model is not None:
        _utf8(model, "model")
    if model is not None and served_model is not None and model != served_model:
        raise NotFound(
            f"The model '{clip(model)}' does not exist.", param="model", code="model_not_found"
        )
    stream = _bool(data, "stream", False)
    options = data.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise ClientError(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise ClientError("'stream_options' must be an object.", param="stream_options")
        _check_stream_options(options)
        include_usage = _bool(options, "include_usage", False)
        # vLLM's meaning: usage on every chunk when there is usage at all
        continuous_usage = include_usage and _bool(options, "continuous_usage_stats", False)
    if stream and limits.force_include_usage:
        # --enable-force-include-usage, as vLLM's (should_include_usage): usage on every
        # chunk and a usage chunk at the end, whatever stream_options say
        include_usage = continuous_usage = True
    logprobs = _logprobs(data, chat, engine_info)
    user = data.get("user")
    for name in ("user", "safety_identifier"):  # the end user, for you: nothing to generate
        if data.get(name) is not None and not isinstance(data[name], str):
            raise ClientError(f"'{name}' must be a string.", param=name)
    request_id = data.get("request_id")
    if request_id is not None and (
        not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id)
    ):
        raise ClientError("'request_id' must be 1 to 128 characters of A-Z a-z 0-9 . _ : -.",
                          param="request_id")
    if chat:
        max_tokens = _int(data, "max_completion_tokens", None, 1, limits.max_tokens)
        if max_tokens is None:
            max_tokens = _int(data, "max_tokens", None, 1, limits.max_tokens)
    else:
        max_tokens = _int(data, "max_tokens", min(16, limits.max_tokens), 1, limits.max_tokens)
    extra = _engine_sampling(data, limits, engine_fields)
    if "prompt_logprobs" in engine_fields:
        prompt_logprobs = _prompt_logprobs(data, engine_info)
        if prompt_logprobs is not None and not (chat and data.get("stream")):
            # (streamed, only 0 gets here, and a chat stream has no place for it: the
            # engine is not asked to compute it; completions decide with echo, below)
            extra["prompt_logprobs"] = prompt_logprobs
    return_token_ids = bool(extra.pop("return_token_ids", False))
    tokens_as_ids = extra.pop("return_tokens_as_token_ids", None)
    if tokens_as_ids is None:  # (vLLM's --return-tokens-as-token-ids: the default)
        tokens_as_ids = limits.tokens_as_ids
    if return_token_ids:
        extra["token_ids"] = extra["prompt_token_ids"] = True
    if logprobs is not None:
        extra["logprobs"] = logprobs
    if data.get("fault") is not None:
        # A test hook (docs/testing.md): refused by name unless the operator enabled it.
        if not limits.allow_faults:
            raise ClientError("'fault' is a test hook that this server does not enable "
                              "(start it with --sim-faults).", param="fault")
        if not isinstance(data["fault"], dict):
            raise ClientError("'fault' must be an object.", param="fault")
        extra["fault"] = data["fault"]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_int(data, "seed", None, -(2**63), 2**63 - 1),
        stop=_stop(data, limits),
        n=_int(data, "n", 1, 1, limits.max_n),
        ignore_eos=_bool(data, "ignore_eos", False),
        extra=extra,
    )
    return {
        "model": model, "params": params, "stream": stream, "include_usage": include_usage,
        "user": user, "logprobs": logprobs, "continuous_usage": continuous_usage,
        "request_id": request_id, "return_token_ids": return_token_ids,
        "prompt_logprobs": extra.get("prompt_logprobs"), "tokens_as_ids": tokens_as_ids,
    }


def _check_answer_size(
    req: GenerateRequest, limits: Limits, engine_info: dict | None
) -> GenerateRequest:
    """Refuse a non-streaming request whose answer could hold more logprobs than
    ``limits.max_answer_logprobs``, before anything runs: the server builds that answer
    as one document (a 200-byte request for n=16 x 900 tokens x top 20 made 19 MB). A
    chat request without ``max_tokens`` counts what fits the context; the prompt's
    logprobs (``prompt_logprobs``, completions' ``echo``) count what its prompts may make
    (:func:`_prompt_tokens_bound`)."""
    most = limits.max_answer_logprobs
    prompt_top = req.params.extra.get("prompt_logprobs")
    if (req.logprobs is None and prompt_top is None) or req.stream or not most:
        return req
    context = (engine_info or {}).get("max_model_len")
    context = context if isinstance(context, int) else limits.max_tokens
    max_tokens = req.params.max_tokens
    if max_tokens is None:
        max_tokens = context
    size = 0
    if req.logprobs is not None:
        size = len(req.prompts) * req.params.n * max_tokens * (req.logprobs + 1)
    if prompt_top is not None:  # (each choice of a prompt carries its prompt's logprobs)
        size += req.params.n * (prompt_top + 1) * sum(
            _prompt_tokens_bound(p, req.tools, context) for p in req.prompts)
    if size > most:
        choices = len(req.prompts) * req.params.n
        if req.logprobs is None:
            raise ClientError(
                f"This answer could hold {size} prompt logprobs ({choices} choices x "
                f"{(prompt_top or 0) + 1} per prompt token), more than the {most} the server builds "
                "for one answer: ask for fewer (n, prompt_logprobs) or a shorter prompt.",
                param="prompt_logprobs",
            )
        param = "top_logprobs" if req.chat else "logprobs"
        unset = "" if req.params.max_tokens is not None else " (max_tokens unset: the context)"
        prompt = "" if prompt_top is None else ", and the prompt's"
        raise ClientError(
            f"This answer could hold {size} logprobs ({choices} choices x {max_tokens} "
            f"tokens{unset} x {req.logprobs + 1} per token{prompt}), more than the {most} "
            f"the server builds for one answer: ask for fewer (n, max_tokens, {param}"
            f"{', prompt_logprobs' if prompt else ''}), or stream it.",
            param=param,
        )
    return req


def _prompt_tokens_bound(prompt, tools: ToolChoice | None, context: int) -> int:
    """At most how many tokens ``prompt`` makes, before a worker tokenizes it, and never
    more than the context.

    * A token-id prompt: its length.
    * A text: its UTF-8 bytes (byte-level and byte-fallback tokenizers make at most one
      token a byte) and 16 special tokens.
    * A chat: its messages and tools as JSON, and 256 tokens of its template's own text
      (the JSON's keys and quotes already exceed a template's markers for each message).
    """
    if is_token_ids(prompt):
        return min(len(prompt), context)
    if isinstance(prompt, str):
        return min(len(prompt.encode("utf-8", "surrogatepass")) + 16, context)
    rendered = [prompt.get("messages"), tools.tools if tools is not None else None]
    return min(len(msgspec.json.encode(rendered)) + 256, context)


def _engine_fields(info: dict | None) -> tuple[frozenset, str]:
    if not info:
        return frozenset(), ""
    if info.get("generate") is False:  # an embedding model
        raise ClientError(
            f"The model '{clip(str(info.get('model')))}' is an embedding model: it serves "
            "/v1/embeddings, not completions.", param="model", code="model_not_supported",
        )
    sampling = set(info.get("sampling") or ())
    if "chat_template_kwargs" in sampling:  # an engine with chat templates: vLLM's options
        sampling |= TEMPLATE_OPTIONS
    if "response_format" in sampling:  # an engine with grammars takes vLLM's spelling too
        sampling.add("structured_outputs")
    if isinstance(info.get("logprobs"), int):
        sampling.add("top_logprobs")  # read by _logprobs
    return frozenset(n for n in sampling if n in UNSUPPORTED), str(info.get("engine") or "")


def parse_completion(
    body: bytes, limits: Limits, served_model: str | None, engine_info: dict | None = None
) -> GenerateRequest:
    """Validate a ``/v1/completions`` body. ``engine_info``: the engine's HELLO info (its
    ``sampling`` fields are accepted, its ``engine`` named when a field is refused).
    ``served_model``: the one ``model`` allowed (404 for another); None: any, the caller
    resolves ``model`` (:func:`server.http.adapters.resolve_model`)."""
    data = decode_json(body, known=True)
    fields, engine = _engine_fields(engine_info)
    check_fields(data, HONOURED_COMPLETION, fields - TOOL_FIELDS - TEMPLATE_OPTIONS, engine)
    common = _common(
        data, limits, served_model, chat=False, engine_fields=fields, engine_info=engine_info
    )
    max_model_len = (engine_info or {}).get("max_model_len")
    if "truncate_prompt_tokens" in common["params"].extra:
        max_model_len = None  # (a token-id prompt past the context may be cut to fit)
    prompts = _prompts(data, limits, common["params"].max_tokens,
                       max_model_len if isinstance(max_model_len, int) else None)
    echo = _bool(data, "echo", False)
    echoed = tuple(p if isinstance(p, str) else None for p in prompts) if echo else ()
    if "chat_template_kwargs" in common["params"].extra:
        raise ClientError(
            "'chat_template_kwargs' is for chat completions: a completions prompt is not "
            "rendered with a template.", param="chat_template_kwargs",
            code="unsupported_parameter",
        )
    if echo and common["logprobs"] is not None:  # the prompt's logprobs too (vLLM's
        # prompt_logprobs, when given, says how many alternatives)
        common["params"].extra.setdefault("prompt_logprobs", common["logprobs"])
    elif data.get("stream"):  # (0, streamed: nothing of it goes out, so none is computed)
        common["params"].extra.pop("prompt_logprobs", None)
    if len(prompts) * common["params"].n > limits.max_n * limits.max_prompts:
        raise ClientError("Too many choices in one request.", param="n")
    return _check_answer_size(
        GenerateRequest(chat=False, prompts=prompts, echo=echo, echoed=echoed, **common),
        limits, engine_info,
    )


def parse_chat(
    body: bytes,
    limits: Limits,
    served_model: str | None,
    engine_info: dict | None = None,
    tool_parser: str | None = None,
) -> GenerateRequest:
    """Validate a ``/v1/chat/completions`` body (``engine_info``: see parse_completion;
    ``tool_parser``: the server's --tool-call-parser, without which tool_choice ``auto``
    is refused)."""
    return chat_request(decode_json(body, known=True), limits, served_model, engine_info,
                        tool_parser)


def chat_request(
    data: dict,
    limits: Limits,
    served_model: str | None,
    engine_info: dict | None = None,
    tool_parser: str | None = None,
) -> GenerateRequest:
    """:func:`parse_chat` of a body already decoded (``data``: a JSON object)."""
    fields, engine = _engine_fields(engine_info)
    tools_ok = "tools" in fields
    fields = fields | TOOL_FIELDS if tools_ok else fields - TOOL_FIELDS
    check_fields(data, HONOURED_CHAT, fields, engine)
    common = _common(
        data, limits, served_model, chat=True, engine_fields=fields, engine_info=engine_info
    )
    messages = messages_of(data, tools_ok, engine_info or {})
    tools = read_tools(data, tool_parser) if tools_ok else None
    if tools is not None:
        tools = _tools_to_engine(tools, common["params"].extra, "response_format" in fields,
                                 engine)
    # vLLM's echo: the last message's content when it is the answer's role's (assistant)
    echo = _bool(data, "echo", False)
    last = messages[-1]
    echoed = ((last.get("content") or "") if last["role"] == "assistant" else "",) if echo else ()
    return _check_answer_size(GenerateRequest(
        chat=True, prompts=[{"messages": messages, **template_options(data, messages)}],
        echo=echo, echoed=echoed, tools=tools,
        include_reasoning=_bool(data, "include_reasoning", True),
        thinking=(template_kwargs_of(data) or {}).get("enable_thinking") is not False,
        **common
    ), limits, engine_info)


#: vLLM's chat template options, read by :func:`template_options` (engines with chat
#: templates only: their HELLO declares ``chat_template_kwargs``).
TEMPLATE_OPTIONS = frozenset({"continue_final_message", "add_generation_prompt"})


def template_options(data: dict, messages: list) -> dict:
    """vLLM's ``continue_final_message`` (the answer continues the last, assistant, message
    instead of starting a new one) and ``add_generation_prompt``, for the chat template;
    only what differs from the defaults goes to the engine."""
    proceed = _bool(data, "continue_final_message", False)
    open_turn = _bool(data, "add_generation_prompt", True)
    if proceed and open_turn and data.get("add_generation_prompt") is not None:
        raise ClientError("'continue_final_message' and 'add_generation_prompt' may not both "
                          "be true.", param="continue_final_message")
    if proceed and messages[-1]["role"] != "assistant":
        raise ClientError("'continue_final_message' needs a final assistant message to "
                          "continue.", param="continue_final_message")
    if proceed:  # (vLLM's meaning: the generation prompt is then left out)
        return {"continue_final_message": True, "add_generation_prompt": False}
    return {} if open_turn else {"add_generation_prompt": False}


def _tools_to_engine(
    tools: ToolChoice, extra: dict, grammar_ok: bool, engine: str
) -> ToolChoice:
    """The engine renders the tools, and forces the grammar of tool_choice required or
    named (as a response_format: it takes no other; it takes precedence over the request's
    own ``response_format``, as in vLLM). With ``auto`` and a JSON ``response_format``,
    the model may write calls or the document (:func:`server.openai.tools.calls_or_document`):
    the tools as they are then parsed are returned."""
    extra["tools"] = tools.tools
    if tools.grammar is None:
        fmt = extra.get("response_format")
        either = calls_or_document(tools, fmt) if fmt is not None else None
        if either is None:
            return tools
        tools, extra["response_format"] = either
        return tools
    if not grammar_ok:
        raise ClientError(
            f"'tool_choice' 'required' or a named function needs structured output, which "
            f"the {engine} engine does not support.", param="tool_choice",
            code="unsupported_parameter",
        )
    # A response_format too (openai-agents sends one with tools on every turn): the call
    # is forced, the format is for a later turn's answer, as OpenAI and vLLM take it.
    # origin: the engine's errors about this grammar name the tool call, not response_format
    extra["response_format"] = {
        "type": "json_schema", "schema": tools.grammar, "origin": "tool_choice"}
    return tools
