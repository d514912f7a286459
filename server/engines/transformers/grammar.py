"""Structured output for the transformers engine: ``response_format`` as a grammar, with
xgrammar (what vLLM and SGLang use by default).

Example::

    grammars = Grammars(tokenizer, vocab_size=V, stop_ids=eos_ids)
    matcher = grammars.matcher({"type": "json_schema", "schema": {"type": "object", ...}})
    grammars.mask(logits, [(row, matcher)])      # the batch's constrained rows, in place
    matcher.accept_token(token)                  # after the pick
    matcher.is_terminated()                      # the JSON is complete and EOS was taken

Compiling a schema can take seconds (thousands of properties, deep nesting, huge enums).
So :meth:`Grammars.compile` runs in a preparation thread (:mod:`server.workers.prepare`),
never on the engine loop, within two budgets:

* a schema's JSON of more than ``max_bytes`` is refused before compiling;
* a compilation that takes longer than ``timeout`` seconds is refused.

Either refusal is a 400 naming ``response_format`` or the forced tool call, with the reason.

A schema with a keyword xgrammar would not enforce (:mod:`.schema_check`) is compiled by
llguidance instead (:mod:`.guidance`, when installed and the engine asks for it). It uses
the same threads, budgets and cache (its key prefixed ``llguidance``). One that llguidance
refuses too is a 400 naming the keyword and llguidance's reason. The schemas inside a
structural tag are checked the same way: one with such a keyword is a 400 naming its
place in the tag (``response_format.structures[0].schema``), as llguidance takes no
structural tag.

A compilation runs in one of ``COMPILE_THREADS`` threads of its own, which a preparation
waits for at most ``timeout``: a thread cannot be killed, so an overlong one finishes in
the background and its result goes to the cache, and at most ``COMPILE_THREADS`` of them
run at once (others queue; their wait counts against their own budget). Compiled grammars
(or their failures) are cached by the schema's compact JSON, in a bounded LRU: a schema sent
with every request is compiled once, and one being compiled is shared.

The mask is one bitmask for the rows that have a grammar, filled per row and applied to the
logits in one call; rows without one are not touched. JSON is generated without free
whitespace between tokens (as vLLM's ``disable_any_whitespace``): a model may not pad a
document forever with blanks. ``{"type": "json_object"}`` is the schema ``{"type":
"object"}`` (vLLM's), so it too is an object without free whitespace (xgrammar's built-in
JSON grammar would take an array or a bare value, padded with tabs and newlines). A
``grammar`` may be GBNF/EBNF or Lark, and a ``structural_tag`` is compiled as vLLM compiles
it (:mod:`.grammar_text`), its JSON strings narrowed as a schema's (below).

xgrammar 0.2.8 writes a string bounded by ``minLength``/``maxLength`` as a repetition of
"any character but a quote, a backslash, CR or LF": raw control characters (U+0000 to
U+001F) pass, and strict JSON parsers (every client's) refuse them. :func:`_json_strings`
narrows that character class in the grammar's text, before it is compiled, to "any
character but a quote, a backslash or a control character" (a bounded string still has no
escapes, as in xgrammar: only characters that JSON takes as they are). Two ``format``
rules have the same fault (found reading the grammar of every format xgrammar implements).
``email``'s quoted local part takes a backslash then any printable character (``\a``, an
invalid JSON escape), and ``json-pointer``'s characters include control characters, the
quote and the backslash. Both are narrowed the same way (an escaped pair is written
``\\`` and a character that needs no escape; a pointer's characters are the printable ones
JSON takes as they are).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ...workers.base import Rejected, one_line
from .grammar_text import compile_text_grammar, structural_tag_grammar
from .guidance import Guidance
from .schema_check import tag_unenforced, unenforced
from ...workers.prep_helper import HelperDied
from ...workers.prepare import DaemonPool

__all__ = [
    "Grammars", "COMPILE_THREADS", "MAX_SCHEMA_BYTES", "COMPILE_TIMEOUT", "constraint_key",
    "describe", "format_param", "tag_param",
]

#: Default budgets (engine options ``grammar_max_bytes`` and ``grammar_timeout``).
MAX_SCHEMA_BYTES = 256 * 1024
COMPILE_TIMEOUT = 10.0
#: Grammar compilations that may run at once.
COMPILE_THREADS = 2
#: Compiled grammars kept.
CACHE_SIZE = 64
#: The cache key's prefix of a JSON schema compiled by llguidance (:mod:`.guidance`).
GUIDED = "llguidance\x00"


def describe(response_format: dict) -> str:
    """What a client calls this constraint: the forced tool call, or response_format."""
    if response_format.get("origin") == "tool_choice":
        return "tool_choice (the forced tool call's grammar)"
    if response_format.get("origin") == "structured_outputs":
        return "structured_outputs"
    return "response_format"


def format_param(response_format: dict) -> str:
    """The client's field a refusal of this constraint names (its ``param``): the tool
    whose parameters schema made the forced call's grammar (``tools``), vLLM's
    ``structured_outputs``, or ``response_format``."""
    origin = response_format.get("origin")
    if origin == "tool_choice":
        return "tools"
    return "structured_outputs" if origin == "structured_outputs" else "response_format"


def tag_param(response_format: dict, where: str) -> str:
    """The ``param`` of a refusal of a structural tag's schema at ``where`` (in the tag,
    :func:`.schema_check.tag_schemas`): its path under ``response_format``, or vLLM's
    ``structured_outputs.structural_tag`` (a JSON text: the message says where)."""
    if response_format.get("origin") == "structured_outputs":
        return "structured_outputs.structural_tag"
    return f"response_format.{where}"


#: The constraint kinds besides JSON (vLLM's structured_outputs, server.openai.structured;
#: a structural tag's text is its JSON): the cache key of each is the kind, a NUL, and its
#: text (a JSON schema's key starts "{").
TEXT_KINDS = ("regex", "grammar", "choice", "structural_tag")
#: The schema ``{"type": "json_object"}`` is compiled as (vLLM's): a JSON object, written
#: without free whitespace as any schema; not xgrammar's built-in JSON grammar, which takes
#: any JSON value (an array, a bare number) padded with any whitespace.
JSON_OBJECT = '{"type":"object"}'


def constraint_key(response_format: dict, max_bytes: int) -> str:
    """The cache key of any constraint (:func:`schema_text` for a JSON schema,
    :data:`JSON_OBJECT`'s for any JSON object), refused (:class:`Rejected`, naming it)
    beyond ``max_bytes``."""
    kind = response_format.get("type")
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        return schema_text(response_format, max_bytes)
    if kind not in TEXT_KINDS:
        raise Rejected(f"unknown response_format type {kind!r}",
                       param=format_param(response_format))
    value = response_format.get(kind)
    text = "\x00".join(value or ()) if kind == "choice" else str(value)
    if len(text.encode()) > max_bytes:
        raise Rejected(f"{describe(response_format)}: the {kind} is too large to compile: more "
                       f"than this server's limit of {max_bytes} bytes",
                       param=format_param(response_format))
    return kind + "\x00" + text


def schema_text(response_format: dict, max_bytes: int) -> str:
    """The compact JSON of a json_schema ``response_format``'s schema (the cache's key),
    refused
    (:class:`Rejected`, naming it) beyond ``max_bytes``."""
    # Keys keep their order: a schema's property order is the order JSON is generated in.
    schema = json.dumps(response_format.get("schema") or {}, separators=(",", ":"),
                        ensure_ascii=False)
    size = len(schema.encode())
    if size > max_bytes:
        raise Rejected(
            f"{describe(response_format)}: the JSON schema is too large to compile: {size} "
            f"bytes, more than this server's limit of {max_bytes}",
            param=format_param(response_format))
    return schema


#: xgrammar 0.2's rules that let through characters JSON strings may not hold raw, each with
#: its strict replacement (see the module docstring): a length-bounded string's character
#: (and a bounded property name's), an email's quoted pair ("\\" then any printable: an
#: invalid JSON escape such as ``\a``), a JSON pointer's character (control characters, a
#: quote and a backslash among them).
_STRICT_RULES = (
    (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'),
    (r'("\\" [ -~])', r'("\\\\" [ !#-[\]-~])'),
    (r'([\0-.]) | ([0-}])', r'([ !#-.]) | ([0-[\]-}])'),
)


def _json_strings(xgr, grammar):
    """``grammar`` with every string's characters valid JSON (see the module docstring);
    ``grammar`` itself when it has no loose rule."""
    text = str(grammar)
    strict = text
    for loose, narrow in _STRICT_RULES:
        strict = strict.replace(loose, narrow)
    return grammar if strict == text else xgr.Grammar.from_ebnf(strict)


class Grammars:
    """The grammars of one model's tokenizer (see the module docstring)."""

    def __init__(self, tokenizer, *, vocab_size: int, stop_ids,
                 max_bytes: int = MAX_SCHEMA_BYTES, timeout: float = COMPILE_TIMEOUT,
                 guidance: bool = False) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self._info = info
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        #: llguidance, for the schemas xgrammar would not enforce (``guidance`` and installed)
        self._guidance: Guidance | None = None
        if guidance and importlib.util.find_spec("llguidance") is not None:
            try:
                self._guidance = Guidance(tokenizer, vocab_size=vocab_size, stop_ids=stop_ids)
            except Exception as exc:  # a tokenizer llguidance cannot read: xgrammar alone
                print(f"transformers engine: llguidance cannot use this tokenizer "
                      f"({one_line(exc)}): schemas that xgrammar would not enforce are "
                      "refused", file=sys.stderr)
        #: (compile(key) -> the compiled grammar's JSON, bytes): a schema whose key is
        #: longer is compiled there (the worker's helper process, server.workers.prep_helper)
        self.remote: tuple | None = None
        self._pool = DaemonPool(COMPILE_THREADS, "grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._hits = 0
        self._misses = 0
        self._timeouts = 0

    def statistics(self) -> dict:
        """Cache hits and misses, compilations refused for time, grammars cached."""
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "timeouts": self._timeouts,
                    "cached": len(self._cache)}

    def compile(self, response_format: dict):
        """The compiled grammar of a request's ``response_format`` (``{"type":
        "json_object"}``, ``{"type": "json_schema", "schema": {...}}``, a structural tag, or
        a regex, grammar or choice of vLLM's ``structured_outputs``), from the cache
        or compiled within the budgets. Any thread (blocks up to ``timeout``); an invalid,
        unsupported, too large or too slow schema is :class:`Rejected` naming the problem."""
        name, param = describe(response_format), format_param(response_format)
        key = constraint_key(response_format, self.max_bytes)
        problem = None
        if response_format.get("type") == "json_schema":
            problem = unenforced(response_format.get("schema"))
            if problem and self._guidance is None:
                raise Rejected(f"{name}: unsupported JSON schema: {problem}", param=param)
            if problem:
                key = GUIDED + key
        elif response_format.get("type") == "structural_tag":  # its schemas, as json_schema's
            found = tag_unenforced(response_format.get("structural_tag"))
            if found:
                where, why = found
                raise Rejected(
                    f"{name}: unsupported JSON schema at {where} of the structural tag: {why}; "
                    "llguidance, which enforces such schemas, does not take structural tags",
                    param=tag_param(response_format, where))
        what = "JSON schema" if key.startswith("{") or problem else key.partition("\x00")[0]
        future = self._future(key)
        try:
            return future.result(timeout=self.timeout)
        except HelperDied:  # an engine fault, not the schema's: not cached
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
            raise
        except FutureTimeout:
            with self._lock:
                self._timeouts += 1
            raise Rejected(
                f"{name}: the {what} did not compile within this server's limit of "
                f"{self.timeout:g} s (simplify it: fewer properties, less nesting, shorter "
                "enums)", param=param) from None
        except Exception as exc:
            if problem:
                raise Rejected(f"{name}: unsupported JSON schema: {problem}; nor can "
                               f"llguidance enforce the schema: {one_line(exc)}",
                               param=param) from None
            raise Rejected(f"{name}: unsupported {what}: {one_line(exc)}",
                           param=param) from None

    def matcher(self, compiled):
        """A fresh matcher for a compiled grammar (quick: the loop's thread)."""
        if isinstance(compiled, self._xgr.CompiledGrammar):
            return self._xgr.GrammarMatcher(compiled)
        assert self._guidance is not None
        return self._guidance.matcher(compiled)

    def close(self) -> None:
        """Stop compiling: queued compilations are dropped, running ones not waited for."""
        self._pool.shutdown()

    def _future(self, key: str) -> Future:
        """The cached compilation of ``key``, started if new."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return future
            self._misses += 1
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, key: str):
        if key.startswith(GUIDED):
            assert self._guidance is not None
            return self._guidance.compile(key[len(GUIDED):])
        remote = self.remote
        if remote is not None and len(key) > remote[1]:
            return self._xgr.CompiledGrammar.deserialize_json(remote[0](key), self._info)
        return self.compile_here(key)

    def compile_here(self, key: str):
        """Compile ``key`` in this process (a pool thread, or the helper process)."""
        if key[0] == "{":
            grammar = self._xgr.Grammar.from_json_schema(key, any_whitespace=False)
            return self._compiler.compile_grammar(_json_strings(self._xgr, grammar))
        kind, _, text = key.partition("\x00")
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "grammar":
            return compile_text_grammar(self._compiler, text)
        if kind == "structural_tag":
            grammar = structural_tag_grammar(self._xgr, text)
            return self._compiler.compile_grammar(_json_strings(self._xgr, grammar))
        # choice: exactly one of the strings, as a grammar of string literals
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in text.split("\x00"))
        return self._compiler.compile_grammar("root ::= " + literals)

    def mask(self, logits, rows: list) -> None:
        """Allow only each constrained row's grammatical next tokens: ``rows`` is
        ``[(row index, matcher), ...]``; ``logits`` is changed in place."""
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
            indices=[row for row, _ in rows],
        )
