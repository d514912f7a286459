"""Which request fields the server honours, which it refuses, which it ignores. Sans-IO.

A client that asks for a penalty, a JSON answer or a tool call and silently gets plain
sampled text with a 200 is worse off than with a 400. So every field of OpenAI's request
schema for ``/v1/completions`` and ``/v1/chat/completions``, and the common vLLM
extensions, is either honoured (read by :mod:`server.openai.schema`) or listed here in
:data:`UNSUPPORTED` with the values that mean "not used" (what clients send by default):
any other value is a 400 naming the field. Fields nobody defines are ignored, as vLLM and
OpenAI do, with a debug log line (clients send extras).

An engine may honour some of them: it lists them in its HELLO info (``"sampling"``, e.g. the
vllm engine's top_k, penalties, logit_bias); those are then validated by
:mod:`server.openai.schema` and passed to it. ``docs/api.md`` has the table, per engine.
"""

from __future__ import annotations

import logging

from ..errors import ClientError, clip, printable

__all__ = [
    "HONOURED_CHAT", "HONOURED_COMPLETION", "KNOWN", "UNSUPPORTED", "check_fields",
    "check_route_fields", "is_neutral",
]

log = logging.getLogger("server.http")

_SAMPLING = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "user", "safety_identifier", "ignore_eos", "logprobs", "fault", "request_id",
}
#: The fields each route reads (``logprobs`` only when false or 0; ``fault`` only with
#: --sim-faults).
HONOURED_COMPLETION = frozenset(_SAMPLING | {"prompt", "echo"})
HONOURED_CHAT = frozenset(
    _SAMPLING | {"messages", "max_completion_tokens", "echo", "include_reasoning"}
)

#: Defined by OpenAI or vLLM, not honoured yet: field -> the values that mean "not used".
UNSUPPORTED: dict[str, tuple] = {
    # sampling (OpenAI)
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    # sampling (vLLM)
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "prompt_logprobs": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "add_special_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    # structured output, tools, reasoning (OpenAI, vLLM)
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    # chat templates (vLLM)
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None, {}),
    # scheduling, caching and disaggregation (vLLM, OpenAI)
    "priority": (None, 0),
    "cache_salt": (None,),
    "prompt_cache_key": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    # other modalities and platform features (OpenAI)
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    # vLLM 0.32's newer request fields
    "logprob_token_ids": (None, []),
    "repetition_detection": (None,),
    "return_prompt_text": (None, False),
    "return_token_offsets": (None, False),
    "stream_interval": (None,),
    "thinking_token_budget": (None,),
    "truncation_side": (None,),
    "watermarking": (None, False),
    "session_id": (None,),
    "ec_transfer_params": (None,),
    "routed_experts_prompt_start": (None, 0),
    "media_io_kwargs": (None, {}),
    "mm_payload": (None, "tensors", "none"),
    "return_mm_kwargs": (None, False),
    "prompt_embeds": (None,),
}

#: Defined, and harmless to accept: they change nothing about the generation.
_NO_OP = frozenset({"metadata"})

#: Every field name either route knows (read, refused, or accepted as a no-op): a big body
#: is parsed skipping the others (:func:`server.openai.schema.decode_json`).
KNOWN = HONOURED_CHAT | HONOURED_COMPLETION | frozenset(UNSUPPORTED) | _NO_OP


def is_neutral(value, neutral: tuple) -> bool:
    """Whether ``value`` is one of the ``neutral`` ones (the values of a field that mean
    "not used"); a bool only as itself (in Python ``True == 1``: ``best_of: true`` is not
    ``best_of: 1``). Every route's refusal of a field it does not honour asks this."""
    for n in neutral:
        if isinstance(value, bool) or isinstance(n, bool):
            if value is n:
                return True
        elif value == n:
            return True
    return False


def check_route_fields(data: dict, honoured: frozenset, refused: dict, route: str) -> None:
    """The fields of a body outside generation (``route``: its path, for the message): a
    name not ``honoured`` is a 400, ``unknown_parameter``, unless ``refused`` has it and
    its value is one of the neutral ones there (else a 400, ``unsupported_parameter``)."""
    for name, value in data.items():
        if name in honoured:
            continue
        neutral = refused.get(name)
        if neutral is None:
            raise ClientError(f"Unrecognized request argument supplied: '{clip(name)}'.",
                              param=clip(name), code="unknown_parameter")
        if not is_neutral(value, neutral):
            raise ClientError(f"'{name}' is not supported by this server's {route}; leave "
                              "it out (or at its default).", param=name,
                              code="unsupported_parameter")


def check_fields(
    data: dict, honoured: frozenset, engine_fields: frozenset = frozenset(), engine: str = ""
) -> None:
    """Refuse a field that has a meaning this server does not honour (400 naming it), and
    log the names nobody defines (ignored). ``engine_fields``: the fields of
    :data:`UNSUPPORTED` that the serving engine declared it honours (its HELLO's
    ``sampling``), read by the schema; ``engine`` names it in the refusal."""
    unknown = []
    refused = []
    for name in data:
        if name in honoured or name in _NO_OP or name in engine_fields:
            continue
        neutral = UNSUPPORTED.get(name)
        if neutral is None:
            unknown.append(name)
        elif not is_neutral(data[name], neutral):
            refused.append(name)
    if refused:
        by = f"the {engine} engine" if engine else "this server"
        names = ", ".join(f"'{name}'" for name in refused)
        verb, it, its = ("is", "it", "its") if len(refused) == 1 else ("are", "them", "their")
        raise ClientError(
            f"{names} {verb} not supported by {by}; leave {it} out (or at {its} default) to "
            f"generate without {it}.",
            param=refused[0],
            code="unsupported_parameter",
        )
    if unknown and log.isEnabledFor(logging.DEBUG):
        log.debug("ignored request fields nobody defines: %s",
                  ", ".join(printable(name, 64) for name in unknown[:20]))
