"""``POST /v1/responses``, the request side: a Responses body validated and translated into
the chat request the engine runs (as vLLM does). Sans-IO.

Theory of operation
-------------------
A Responses request is a chat request in other clothes: ``input`` (a string, or items:
messages, function calls and their outputs) and ``instructions`` become chat
``messages``; flat function ``tools`` and ``tool_choice`` become chat's nested ones;
``text.format`` becomes ``response_format``; ``max_output_tokens`` becomes
``max_completion_tokens``. The translated body goes through :func:`schema.parse_chat`, so
every rule of the chat route holds here too: engine fields, the tool parser, the
forced-call grammar, ``tool_choice: auto`` with a JSON format letting the model write calls
or the document, limits. A 400 it raises is renamed back to the Responses field the client
sent (``text.format``, ``input[2].content``, ``tools[0].parameters``).

What the chat route has no counterpart for is decided here: fields nobody defines are a
400 naming them (``unknown_parameter``, as OpenAI answers on this route), and the stateful
features this server does not have (``conversation``, stored ``prompt`` templates) are
refused by name; ``background`` needs ``store`` (:mod:`server.http.responses_background`).
``docs/api.md`` has the table.

Stored responses (``store``, ``previous_response_id``) take two steps, so that the route
can read the earlier response from the state store between them
(:mod:`server.http.responses_store`): :func:`read_responses` decodes and checks the body
(``store`` resolved: absent means stored when the server has a store, OpenAI's default),
then :func:`translate_responses` builds the chat request with the earlier turns' items
(``context``) before this request's ``input``. :func:`parse_responses` is both at once,
for a server without a store.

Example::

    req = parse_responses(b'{"input": "hi", "max_output_tokens": 8}', limits, "sim")
    req.chat.prompts   # [{"messages": [{"role": "user", "content": "hi"}]}]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import Limits
from ..errors import ClientError, printable
from .encode import dumps
from .fields import is_neutral
from .responses_items import input_items
from .images import ImageRef
from .schema import GenerateRequest, decode_json, parse_chat

__all__ = ["HONOURED", "REFUSED", "ResponsesRequest", "parse_responses", "read_responses",
           "translate_responses"]

#: The fields this route reads (``fault`` only with --sim-faults).
HONOURED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "max_output_tokens", "temperature", "top_p", "stream", "user", "metadata",
    "safety_identifier", "fault", "store", "previous_response_id", "background",
})

#: OpenAI's fields this server does not honour: field -> (values that mean "not used", why).
REFUSED: dict[str, tuple[tuple, str]] = {
    "conversation": ((None,), "this server keeps no conversations"),
    "prompt": ((None,), "this server keeps no prompt templates"),
    "include": ((None, []), "no extra outputs (logprobs, encrypted reasoning) are made"),
    "truncation": ((None, "disabled"), "the input is never truncated"),
    "max_tool_calls": ((None,), "the number of calls is bounded by parallel_tool_calls only"),
    "top_logprobs": ((None, 0), "logprobs are not served on this route"),
    "service_tier": ((None, "auto", "default"), "there is one tier"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "no obfuscation is added"),
    "prompt_cache_key": ((None,), "the router places requests by their prompts' prefixes "
                         "itself (docs/routing.md); a key is not used"),
    "prompt_cache_retention": ((None,), "the prefix cache is the engine's"),
    "context_management": ((None,), "the input is never compacted"),
}

#: Responses content part types that carry text, and the inputs that are not text.
_TEXT_PARTS = ("input_text", "output_text")
_OTHER_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")

#: Chat's field names in a translated request's errors -> the Responses field.
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)$")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function(.*)$")


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the chat request the engine runs, and the request's
    fields as the Response object echoes them."""

    chat: GenerateRequest
    echo: dict
    #: Whether the answer is kept in the state store, and the items it keeps as its input
    #: (the earlier turns' and this request's: responses_items).
    store: bool = False
    items: list = field(default_factory=list)
    #: Who keeps it (server.state.owner_of the request's API key; set by the route).
    owner: str = ""
    #: Run in the server's background service (server.http.responses_background).
    background: bool = False

    @property
    def prompts(self) -> list:
        return self.chat.prompts

    @property
    def params(self):
        return self.chat.params

    @property
    def stream(self) -> bool:
        return self.chat.stream

    @property
    def model(self) -> str | None:
        return self.chat.model

    @property
    def request_id(self) -> None:
        return None  # not a field of this route (X-Request-Id is)

    @property
    def echoed(self) -> tuple:
        return self.chat.echoed  # empty: nothing is echoed on this route


def _refuse(name: str, why: str, code: str = "unsupported_parameter") -> ClientError:
    return ClientError(f"'{name}' is not supported: {why}.", param=name, code=code)


def check_fields(data: dict) -> None:
    """A 400 naming a field nobody defines (OpenAI's answer on this route), or one of
    :data:`REFUSED` at other than a neutral value."""
    for name, value in data.items():
        if name in HONOURED:
            continue
        refused = REFUSED.get(name)
        if refused is None:
            raise ClientError(f"Unknown parameter: '{printable(name)}'.", param=name,
                              code="unknown_parameter")
        if not is_neutral(value, refused[0]):
            raise _refuse(name, refused[1])


def _text_of(content, param: str, images: bool = False) -> str | list:
    """A message's content (a string or a list of text parts) as one string; with
    ``images`` (a message's content), a list of chat parts when it holds ``input_image``
    parts (each a chat ``image_url`` part at the same index: parse_chat decides whether
    the engine takes it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ClientError("'content' must be a string or a list of content parts.", param=param)
    texts: list = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            texts.append(_image_part(part, f"{param}[{j}]"))
            continue
        if isinstance(kind, str) and kind in _OTHER_PARTS:
            raise ClientError(
                f"Content parts of type '{kind}' are not supported: the engine takes text "
                f"only (no {_OTHER_PARTS[kind]} input).", param=f"{param}[{j}]",
                code="unsupported_parameter",
            )
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ClientError(
                "A content part must be {\"type\": \"input_text\" (or \"output_text\" in an "
                "assistant message), \"text\": ...}.", param=f"{param}[{j}]",
            )
        texts.append(part["text"])
    if all(isinstance(t, str) for t in texts):
        return "".join(texts)
    return [t if isinstance(t, dict) else {"type": "text", "text": t} for t in texts]


def _image_part(part: dict, param: str) -> dict:
    """An ``input_image`` part as chat's ``image_url`` part (a URL; ``file_id`` refused)."""
    for name in part:
        if name not in ("type", "image_url", "file_id", "detail"):
            raise ClientError(f"Unknown field '{printable(str(name))}' of an input_image "
                              "part.", param=f"{param}.{printable(str(name))}",
                              code="unknown_parameter")
    if part.get("file_id") is not None:
        raise ClientError("'file_id' images are not supported: give the image's URL (a "
                          "data: URL for its bytes) in 'image_url'.", param=f"{param}.file_id",
                          code="unsupported_parameter")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise ClientError("An input_image part needs a string 'image_url'.",
                          param=f"{param}.image_url")
    body = {"url": url}
    if part.get("detail") is not None:
        body["detail"] = part["detail"]
    return {"type": "image_url", "image_url": body}


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning input item's text: its ``reasoning_text`` content (this server's
    output), else its summary; encrypted reasoning (OpenAI's) cannot be read."""
    if item.get("encrypted_content") is not None:
        raise ClientError("Encrypted reasoning cannot be read by this server.",
                          param=f"{param}.encrypted_content", code="unsupported_parameter")
    texts: list[str] = []
    for name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
            for p in parts
        ):
            raise ClientError(f"'{name}' must be a list of {{\"type\": \"{kind}\", "
                              "\"text\": ...}} parts.", param=f"{param}.{name}")
        if parts and not texts:
            texts = [p["text"] for p in parts]
    return "".join(texts)


def _entries(data: dict, context: list) -> list[tuple[str, object]]:
    """The items of the conversation, each with the Responses field it came from: the
    earlier turns' (``previous_response_id``), then ``input`` (a string: one user message)."""
    entries: list[tuple[str, object]] = [("previous_response_id", item) for item in context]
    items = data.get("input")
    if isinstance(items, str):
        return entries + [("input", {"role": "user", "content": items})]
    if not isinstance(items, list) or not items:
        raise ClientError("'input' must be a string or a non-empty list of items.", param="input")
    return entries + [(f"input[{i}]", item) for i, item in enumerate(items)]


def _messages(data: dict, context: list) -> tuple[list, list, dict]:
    """``instructions``, the earlier turns' items (``context``) and ``input`` as chat
    messages, for each message the Responses field it came from (for each assistant
    message's tool calls too: see _rename), and the reasoning of assistant messages
    (message index -> the text of the ``reasoning`` items before it: the chat template's
    ``reasoning_content``)."""
    messages: list = []
    where: list = []  # per message: (param, [param of each tool call])
    reasoning: dict = {}
    pending: tuple | None = None  # (param of the first, texts) of reasoning items not placed
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ClientError("'instructions' must be a string.", param="instructions")
        messages.append({"role": "system", "content": instructions})
        where.append(("instructions", []))
    for param, item in _entries(data, context):
        if not isinstance(item, dict):
            raise ClientError("Each input item must be an object.", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            text = _reasoning_text(item, param)
            pending = (pending[0] if pending else param, (pending[1] if pending else "") + text)
            continue
        opens_turn = (kind == "message" and item.get("role") == "assistant") or (
            kind == "function_call" and (pending is not None or not messages
                                         or messages[-1]["role"] != "assistant"))
        if pending is not None and not opens_turn:  # a turn of thinking alone
            _thinking_turn(messages, where, reasoning, pending)
        elif pending is not None:
            reasoning[len(messages)] = pending[1]
        pending = None
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise ClientError(f"'role' must be one of {', '.join(_MESSAGE_ROLES)}.",
                                  param=f"{param}.role")
            if "content" not in item:
                raise ClientError("A message needs 'content'.", param=f"{param}.content")
            content = _text_of(item["content"], f"{param}.content", images=True)
            messages.append({"role": role, "content": content})
            where.append((param, []))
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise ClientError(f"A function call needs a string '{name}'.",
                                      param=f"{param}.{name}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not opens_turn:  # the same turn as the assistant message before it
                messages[-1].setdefault("tool_calls", []).append(call)
                where[-1][1].append(param)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                where.append((param, [param]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ClientError("A function call output needs a string 'call_id'.",
                                  param=f"{param}.call_id")
            if "output" not in item:
                raise ClientError("A function call output needs 'output'.",
                                  param=f"{param}.output")
            output = _text_of(item["output"], f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            where.append((param, []))
        else:
            raise ClientError(
                f"Input items of type {printable(repr(kind))} are not supported: messages, "
                "reasoning, "
                "function_call and function_call_output only (hosted tool items and item "
                "references are not taken).",
                param=f"{param}.type" if kind is not None else param,
                code="unsupported_parameter",
            )
    if pending is not None:
        _thinking_turn(messages, where, reasoning, pending)
    return messages, where, reasoning


def _thinking_turn(messages: list, where: list, reasoning: dict, pending: tuple) -> None:
    """Reasoning items followed by no assistant message or call (an answer cut while it
    thought): an assistant turn of that reasoning and no content."""
    reasoning[len(messages)] = pending[1]
    messages.append({"role": "assistant", "content": ""})
    where.append((pending[0], []))


def _tools(data: dict) -> list | None:
    """Flat Responses function tools as chat's nested ones."""
    tools = data.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ClientError("'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ClientError(
                f"Tools of type {printable(repr(kind))} are not supported: function tools only "
                "(hosted tools "
                "are OpenAI's).", param=f"tools[{i}].type", code="unsupported_parameter",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(data: dict):
    choice = data.get("tool_choice")
    if choice is None or isinstance(choice, str):
        return choice  # chat's rules: none, auto, required
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ClientError(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        "\"name\": ...}.", param="tool_choice",
    )


def _text_format(data: dict) -> dict | None:
    text = data.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ClientError("'text' must be an object.", param="text")
    for name in text:
        if name == "verbosity":
            if text[name] not in (None, "medium"):
                raise _refuse("text.verbosity", "the model's answer is not steered")
        elif name != "format":
            raise ClientError(f"Unknown parameter: 'text.{printable(name)}'.",
                              param=f"text.{name}", code="unknown_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise ClientError(
            "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
            "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}.", param="text.format",
        )
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
    if not isinstance(spec.get("schema"), dict):
        raise ClientError("'text.format' needs a 'schema' object.", param="text.format.schema")
    if not isinstance(fmt.get("name"), str):
        raise ClientError("'text.format' needs a string 'name'.", param="text.format.name")
    return {"type": "json_schema", "json_schema": spec}


def _reasoning(data: dict) -> None:
    """``reasoning``: accepted when it asks for nothing (the reasoning parser, a server
    option, decides whether the answer is split); an effort or a summary is a 400."""
    value = data.get("reasoning")
    if value is None:
        return
    if not isinstance(value, dict):
        raise ClientError("'reasoning' must be an object.", param="reasoning")
    for name, item in value.items():
        if item is not None:
            raise _refuse(f"reasoning.{name}",
                          "the model's reasoning is neither steered nor summarised")


def _rename(exc: ClientError, where: list) -> ClientError:
    """A 400 of the translated chat request, naming the Responses field instead."""
    param = exc.param
    message = exc.message
    if param is None:
        return exc
    for old, new in _RENAMED.items():
        message = message.replace(f"'{old}'", f"'{new}'")
        if param == old:
            param = new
    out = ClientError(message, param=_renamed(param, where), code=exc.code)
    out.status = exc.status
    return out


def _renamed(param: str, where: list) -> str:
    """A chat request's field (``param``) as the Responses field it came from."""
    m = _MESSAGE_PARAM.match(param)
    if m is not None and int(m[1]) < len(where):
        base, calls = where[int(m[1])]
        if m[2] is not None and int(m[2]) < len(calls):
            base = calls[int(m[2])]
        rest = m[3] or ""
        for old, new in (".image_url.url", ".image_url"), (".image_url.detail", ".detail"):
            if rest.endswith(old):  # (an input_image part's fields are flat)
                rest = rest[: -len(old)] + new
        param = base + rest
    m = _TOOL_PARAM.match(param)
    if m is not None:
        param = f"tools[{m[1]}]{m[2]}"
    return param


def _name_images(messages: list, where: list) -> None:
    """Each image ref of the translated ``messages`` named by its Responses field, for
    the fetch's refusals."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [
                ImageRef(p.url, p.detail, _renamed(p.param, where),
                         _renamed(p.param, where) + ".image_url")
                if isinstance(p, ImageRef) else p for p in content]


#: Why a server without a state store refuses ``store: true`` and ``previous_response_id``.
_NO_STORE = "this server keeps no responses (it runs without a state store)"


def read_responses(body: bytes, can_store: bool) -> dict:
    """A ``/v1/responses`` body, decoded and its fields checked (a 400 naming one that is
    wrong), with ``store`` resolved to a bool: as sent, else ``can_store`` (OpenAI's
    default is true: a server with a state store keeps what the client did not ask it not
    to). ``can_store``: the server has a state store; without one, ``store: true`` and
    ``previous_response_id`` are a 400 naming them."""
    data = decode_json(body)
    check_fields(data)
    store = data.get("store")
    if store is not None and not isinstance(store, bool):
        raise ClientError("'store' must be a boolean.", param="store")
    if store and not can_store:
        raise _refuse("store", _NO_STORE)
    data["store"] = can_store if store is None else store
    background = data.get("background")
    if background is not None and not isinstance(background, bool):
        raise ClientError("'background' must be a boolean.", param="background")
    if background and not data["store"]:
        raise ClientError("'background' needs the response stored: send 'store' true "
                          "(or leave it out)" + ("" if can_store else f"; {_NO_STORE}") + ".",
                          param="background")
    data["background"] = bool(background)
    previous = data.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise ClientError("'previous_response_id' must be a response's id.",
                              param="previous_response_id")
        if not can_store:
            raise _refuse("previous_response_id", f"{_NO_STORE}: send the whole "
                          "conversation in 'input'")
    return data


def parse_responses(
    body: bytes,
    limits: Limits,
    served_model: str | None,
    engine_info: dict | None = None,
    tool_parser: str | None = None,
) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body and translate it into a chat request, on a server
    without a state store (see the module docstring); a 400 naming the Responses field for
    anything wrong."""
    return translate_responses(read_responses(body, can_store=False), limits, served_model,
                               engine_info, tool_parser)


def translate_responses(
    data: dict,
    limits: Limits,
    served_model: str | None,
    engine_info: dict | None = None,
    tool_parser: str | None = None,
    context: list | None = None,
) -> ResponsesRequest:
    """Translate a body :func:`read_responses` read into a chat request, the earlier turns'
    items (``context``: :func:`~server.openai.responses_items.context_of` the response
    ``previous_response_id`` names) before ``input``; a 400 naming the Responses field
    for anything wrong."""
    context = context or []
    _reasoning(data)
    if not isinstance(data.get("metadata") or {}, dict):
        raise ClientError("'metadata' must be an object.", param="metadata")
    messages, where, reasoning = _messages(data, context)
    chat: dict = {"messages": messages}
    for name in ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls",
                 "fault"):
        if name in data:
            chat[name] = data[name]
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    tools = _tools(data)
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(data)
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_format(data)
    if fmt is not None and fmt["type"] != "text":
        chat["response_format"] = fmt
    try:
        req = parse_chat(dumps(chat), limits, served_model, engine_info, tool_parser)
    except ClientError as exc:
        raise _rename(exc, where) from None
    rendered = req.prompts[0]["messages"]  # one per message, in order (schema.messages_of)
    _name_images(rendered, where)
    for index, thought in reasoning.items():
        rendered[index]["reasoning_content"] = thought
    params = req.params
    echo = {
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "parallel_tool_calls": req.tools.parallel if req.tools is not None else True,
        "temperature": params.temperature,
        "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": _echo_choice(data.get("tool_choice")),
        "tools": [_echo_tool(t) for t in data.get("tools") or ()],
        "top_p": params.top_p,
        "user": data.get("user"),
        "store": data["store"],
        "previous_response_id": data.get("previous_response_id"),
        "background": data.get("background", False),
    }
    items = context + input_items(data["input"]) if data["store"] else []
    return ResponsesRequest(req, echo, store=data["store"], items=items,
                            background=data.get("background", False))


def _echo_choice(choice) -> object:
    """The echoed ``tool_choice``: as sent, else OpenAI's default, ``auto`` (with tools or
    without)."""
    return "auto" if choice is None else choice


def _echo_tool(tool: dict) -> dict:
    """A function tool as the Response object echoes it (``strict`` as sent: under
    ``tool_choice: auto`` the arguments are not constrained, see docs/api.md)."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}
