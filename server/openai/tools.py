"""Tool calling, the request side: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
tool calls in the history, validated into what the engine and the writer need. Sans-IO.

Example::

    choice = read_tools(data, parser="hermes")   # None: the request has no tools
    choice.tools         # for the chat template (``apply_chat_template(tools=...)``)
    choice.parse         # "hermes", "forced" (required / named: the grammar's JSON) or None
    choice.grammar       # the JSON schema forced with tool_choice required / named, or None

What each ``tool_choice`` does (docs/api.md, "Tool calls"):

- ``auto`` (the default with tools): the tools are rendered by the chat template and the
  output is parsed with ``--tool-call-parser``. With a JSON ``response_format`` too (dspy's
  JSONAdapter, an agent's structured final answer), the model chooses, as OpenAI's does.
  The grammar is then the union of the calls array that ``required`` forces and the
  document (:func:`calls_or_document`), parsed as ``calls_or_document``;
- ``none``: the tools are rendered (as vLLM does), the output is not parsed: all content;
- ``required``, or ``{"type": "function", "function": {"name": ...}}``: the output is forced
  by a grammar to be the JSON array ``[{"name": ..., "arguments": {...}}, ...]``, each
  ``arguments`` valid for its function's ``parameters`` schema. A named function gets one
  call of it; ``parallel_tool_calls: false``, one call at most. The writer parses that
  array into ``tool_calls`` (the ``forced`` format of :mod:`server.openai.tool_parsers`).

Served when the engine declares ``tools`` in its HELLO ``sampling`` (it renders them with
its chat template); otherwise the fields are a 400 naming them, as are tool calls in the
history. Only ``auto`` parses free text, so only ``auto`` needs ``--tool-call-parser``
(as vLLM's needs ``--enable-auto-tool-choice``): without one it is a 400 naming the
option; ``none``, ``required``, named functions and the history need none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import unquote

from ..errors import ClientError
from .json_schema import check_grammar_ints, check_refs, rebase
from .tool_parsers import CALLS_OR_DOCUMENT

__all__ = ["TOOL_FIELDS", "ToolChoice", "calls_or_document", "history_message", "read_tools"]

#: The request fields of tool calling (an engine declares ``tools``; the others follow).
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools, as the engine and the writer need them."""

    #: The tools as the chat template takes them (OpenAI's shape).
    tools: list
    #: How the output is parsed: a --tool-call-parser name, "forced", or None (not parsed).
    parse: str | None
    #: ``parallel_tool_calls``.
    parallel: bool
    #: The JSON schema of the output (tool_choice required or named), else None.
    grammar: dict | None


def _tool(tool, i: int, names: set) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ClientError('Each tool must be {"type": "function", "function": {...}}.', param=param)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ClientError("A tool needs a 'function' object.", param=f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ClientError(
            "A function's 'name' must be 1 to 64 letters, digits, '_' or '-'.",
            param=f"{param}.function.name",
        )
    if name in names:
        raise ClientError(f"Two tools are named {name!r}.", param=f"{param}.function.name")
    names.add(name)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ClientError("'description' must be a string.", param=f"{param}.function.description")
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ClientError(
                "'parameters' must be a JSON schema of an object "
                '({"type": "object", "properties": {...}}).',
                param=f"{param}.function.parameters",
            )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ClientError("'strict' must be a boolean.", param=f"{param}.function.strict")
    out: dict = {"name": name}
    if description is not None:
        out["description"] = description
    out["parameters"] = parameters if parameters is not None else {
        "type": "object", "properties": {}}
    return {"type": "function", "function": out}


def _call_schema(fn: dict) -> dict:
    """The schema of one call of ``fn``; its arguments refer to the grammar's
    ``$defs[name]`` (see :func:`_grammar`)."""
    return {
        "type": "object",
        "properties": {"name": {"enum": [fn["name"]]},
                       "arguments": {"$ref": f"#/$defs/{fn['name']}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _grammar(fns: list, most_one: bool) -> dict:
    """The JSON schema of the output of tool_choice required or named: an array of calls
    of ``fns``. Each function's ``parameters`` sit under the root's ``$defs`` by the
    function's name, their own references (``#/$defs/Item`` of a pydantic model, ``#``
    for recursion) rebased there (:func:`server.openai.json_schema.rebase`; xgrammar's
    pointers cannot index into an ``anyOf`` list, so they may not sit inside one)."""
    items = _call_schema(fns[0]) if len(fns) == 1 else {"anyOf": [_call_schema(f) for f in fns]}
    grammar: dict = {"type": "array", "items": items, "minItems": 1}
    if most_one:
        grammar["maxItems"] = 1
    grammar["$defs"] = {f["name"]: rebase(f["parameters"], f"#/$defs/{f['name']}") for f in fns}
    return grammar


def render_tools(data: dict) -> list:
    """The request's ``tools`` as the chat template takes them (``[]`` for none); a 400
    naming the field for a malformed tool."""
    tools = data.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > _MAX_TOOLS:
        raise ClientError(f"'tools' must be a list of at most {_MAX_TOOLS} tools.", param="tools")
    names: set = set()
    return [_tool(t, i, names) for i, t in enumerate(tools)]


def read_tools(data: dict, parser: str | None) -> ToolChoice | None:
    """The request's tools and tool_choice (None: no tools, nothing to parse); 400s naming
    the field for a malformed tool, an unknown tool_choice, a named function not given, or
    ``auto`` when the server has no tool call ``parser``."""
    rendered = render_tools(data)
    names = {t["function"]["name"] for t in rendered}
    parallel = data.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ClientError("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    choice = data.get("tool_choice")
    if choice is None:
        choice = "auto" if rendered else "none"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ClientError(
                'A named \'tool_choice\' is {"type": "function", "function": {"name": ...}}.',
                param="tool_choice",
            )
        if name not in names:
            raise ClientError(f"'tool_choice' names {name!r}, which is not in 'tools'.",
                              param="tool_choice")
        named = name
    elif choice not in ("none", "auto", "required"):
        raise ClientError(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.', param="tool_choice",
        )
    if not rendered:
        if choice in ("none", "auto"):
            return None
        raise ClientError("'tool_choice' needs 'tools'.", param="tool_choice")
    if choice == "none":
        return ToolChoice(rendered, None, parallel, None)
    if choice == "auto":
        if parser is None:
            given = data.get("tool_choice") is not None
            raise ClientError(
                "'tool_choice' 'auto'" + ("" if given else " (the default with 'tools')")
                + " needs a server started with --tool-call-parser (hermes, llama3_json or "
                "mistral) to find the calls in the answer; 'required', a named function and "
                "'none' need none.",
                param="tool_choice" if given else "tools", code="unsupported_parameter",
            )
        return ToolChoice(rendered, parser, parallel, None)
    fns = []
    for i, t in enumerate(rendered):
        if named is None or t["function"]["name"] == named:
            # (checked when compiled: auto and none only render the schemas, as vLLM does)
            check_refs(t["function"]["parameters"], f"tools[{i}].function.parameters")
            check_grammar_ints(t["function"]["parameters"], f"tools[{i}].function.parameters")
            fns.append(t["function"])
    grammar = _grammar(fns, named is not None or not parallel)
    return ToolChoice(rendered, "forced", parallel, grammar)


#: Where the document's schema sits in the grammar of :func:`calls_or_document` (not a
#: function's name: those have no '.').
_DOCUMENT = "document.format"


def calls_or_document(tools: ToolChoice, fmt: dict) -> tuple[ToolChoice, dict] | None:
    """``tool_choice: auto`` with a JSON ``response_format`` (``fmt``, the engine's
    ``json_schema`` or ``json_object``): the tools parsed as :data:`CALLS_OR_DOCUMENT`,
    and the engine's ``response_format`` whose schema lets the model write either the
    calls (the array ``required`` forces, :func:`_grammar`) or the document. The format
    over the whole output would leave the model no way to call a tool. None when this
    does not apply (another tool_choice, or a regex, choice or grammar constraint: those
    hold over the whole output, as in vLLM). A document whose root may be an array
    (``{"type": "array"}``, ``{}``, an ``anyOf`` with an array) is a 400 naming the format:
    the parser tells the branches apart by the first character, ``[`` for the calls, and
    an array document would be read as calls and lost (:func:`_may_be_array`)."""
    if tools.parse in (None, "forced") or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    calls = read_tools({"tools": tools.tools, "tool_choice": "required",
                        "parallel_tool_calls": tools.parallel}, tools.parse)
    assert calls is not None and calls.grammar is not None
    document = fmt["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
    if _may_be_array(document, document, 0):
        field = fmt.get("origin", "response_format")
        raise ClientError(
            f"'{field}' with 'tools' (tool_choice 'auto'): the document's schema may be a JSON "
            "array, which could not be told from the array of tool calls the model may write "
            "instead; give the schema a root 'type' other than 'array' (an object, as "
            "OpenAI's structured outputs require), or send tool_choice 'none' or 'required'.",
            param=field,
        )
    # Both under one root: the calls' tool parameters already sit in its $defs, and the
    # document joins them there with its own references rebased (xgrammar's pointers cannot
    # index into the anyOf list).
    grammar = dict(calls.grammar)
    defs = dict(grammar.pop("$defs", {}))
    defs[_DOCUMENT] = rebase(document, f"#/$defs/{_DOCUMENT}")
    union = {"anyOf": [grammar, {"$ref": f"#/$defs/{_DOCUMENT}"}], "$defs": defs}
    engine_fmt = {"type": "json_schema", "schema": union}
    if "origin" in fmt:
        engine_fmt["origin"] = fmt["origin"]
    return ToolChoice(tools.tools, CALLS_OR_DOCUMENT, tools.parallel, None), engine_fmt


#: How many references :func:`_may_be_array` follows before it takes the answer to be yes.
_MAX_HOPS = 32


def _may_be_array(root, node, hops: int) -> bool:
    """Whether a JSON array may be valid for the schema ``node`` (of the document ``root``,
    whose references are local pointers, :func:`check_refs`): yes unless its ``type``,
    ``const``, ``enum``, ``$ref``, ``allOf``, ``anyOf`` or ``oneOf`` rule arrays out
    (``{}``, and a schema of only object keywords without ``type``, admit arrays)."""
    if not isinstance(node, dict):
        return node is not False
    if hops > _MAX_HOPS:
        return True
    kind = node.get("type")
    if isinstance(kind, str) and kind != "array":
        return False
    if isinstance(kind, list) and "array" not in kind:
        return False
    if "const" in node and not isinstance(node["const"], list):
        return False
    enum = node.get("enum")
    if isinstance(enum, list) and not any(isinstance(v, list) for v in enum):
        return False
    ref = node.get("$ref")
    if isinstance(ref, str) and not _may_be_array(root, _pointed(root, ref), hops + 1):
        return False
    every = node.get("allOf")
    if isinstance(every, list) and not all(_may_be_array(root, s, hops + 1) for s in every):
        return False
    for key in ("anyOf", "oneOf"):
        some = node.get(key)
        if isinstance(some, list) and not any(_may_be_array(root, s, hops + 1) for s in some):
            return False
    return True


def _pointed(root, ref: str):
    """The subschema a local JSON pointer names (True, any value, when it names nothing)."""
    node = root
    for token in ref[2:].split("/") if ref.startswith("#/") else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or token not in node:
            return True
        node = node[token]
    return node


def history_message(m: dict, i: int, role: str, text: str | list, tools_ok: bool) -> dict:
    """A history message for the chat template: assistant ``tool_calls`` (their
    ``arguments`` as objects, as Hugging Face templates expect) and ``tool`` results; a 400
    when the server does not serve tools."""
    calls = m.get("tool_calls") if role == "assistant" else None
    if not (role == "tool" or calls or (role == "assistant" and m.get("function_call"))):
        return {"role": role, "content": text}
    if not tools_ok:
        raise ClientError(
            "Tool calls and tool results in the conversation need an engine that renders "
            "tools.",
            param=f"messages[{i}]" + (".tool_calls" if calls else ""),
            code="unsupported_parameter",
        )
    if role == "assistant" and not calls:
        raise ClientError("'function_call' is deprecated: give 'tool_calls'.",
                          param=f"messages[{i}].function_call")
    if role == "tool":
        out = {"role": "tool", "content": text, "tool_call_id": m["tool_call_id"]}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out
    if not isinstance(calls, list):
        raise ClientError("'tool_calls' must be a list.", param=f"messages[{i}].tool_calls")
    rendered = []
    for j, call in enumerate(calls):
        param = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
            call.get("id"), str
        ):
            raise ClientError(
                'A tool call is {"id": ..., "type": "function", "function": {"name": ..., '
                '"arguments": "<JSON>"}}.', param=param,
            )
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ClientError("'arguments' must be a JSON object.",
                                  param=f"{param}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise ClientError("'arguments' must be a JSON object.",
                              param=f"{param}.function.arguments")
        rendered.append({"id": call["id"], "type": "function",
                         "function": {"name": fn["name"], "arguments": arguments}})
    return {"role": "assistant", "content": text, "tool_calls": rendered}
