"""``POST /v1/chat/completions/batch``: several conversations in one request, as vLLM
serves them.

The body is a chat completions body whose ``messages`` is a list of conversations (each a
non-empty list of messages); the answer is one chat completion with a choice per
conversation, ``index`` 0 to N-1, and usage summed over them. The conversations run as the
prompts of one request (the engine batches them; an abort or a disconnect ends them all),
on the generation path of :mod:`server.http.generate`: only the parsing differs, and the
answer is chat's non-streaming one.

What vLLM's batch endpoint does not take is refused by name here too: ``stream``,
``tools``/``tool_choice``, ``n`` other than 1, beam search. Every other field means what it
means on ``/v1/chat/completions``, for each conversation alike.
"""

from __future__ import annotations

import dataclasses

from ..errors import ClientError
from .answer import write_full
from .post import off_loop
from ..openai.schema import GenerateRequest, chat_request, decode_json

__all__ = ["PATH", "ROUTE", "parse_chat_batch"]

PATH = "/v1/chat/completions/batch"

#: Fields the batch endpoint refuses unless at their neutral value (vLLM's limits).
_NOT_IN_A_BATCH = {
    "stream": (None, False),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "use_beam_search": (None, False),
    "n": (None, 1),
}


def parse_chat_batch(body: bytes, limits, served_model: str | None, engine_info: dict | None = None,
                     tool_parser: str | None = None) -> GenerateRequest:
    """Validate a batch body: each conversation as a chat request of its own (the first
    error names the conversation), then one request with a prompt per conversation."""
    data = decode_json(body, known=True)
    conversations = data.get("messages")
    if not (isinstance(conversations, list) and conversations
            and all(isinstance(c, list) and c for c in conversations)):
        raise ClientError(
            "'messages' must be a non-empty list of conversations, each a non-empty list of "
            "messages.", param="messages",
        )
    if len(conversations) > limits.max_prompts:
        raise ClientError(f"At most {limits.max_prompts} conversations per request.",
                          param="messages")
    for name, neutral in _NOT_IN_A_BATCH.items():
        value = data.get(name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise ClientError(
                f"'{name}' is not supported by {PATH} (as in vLLM); use /v1/chat/completions.",
                param=name,
            )
    requests = []
    for i, conversation in enumerate(conversations):
        try:
            requests.append(chat_request({**data, "messages": conversation}, limits,
                                         served_model, engine_info, tool_parser))
        except ClientError as exc:
            raise ClientError(f"Conversation {i}: {exc.message}", param=exc.param,
                              code=exc.code) from None
    first = requests[0]
    return dataclasses.replace(
        first,
        prompts=[p for r in requests for p in r.prompts],
        echoed=tuple(e for r in requests for e in r.echoed),
    )


class ChatBatchRoute:
    """What handle_generate needs of a route: parse a body, write the answer."""

    id_prefix = "chatcmpl-"

    @staticmethod
    async def parse(app, scope: dict, body: bytes, engine_info: dict) -> GenerateRequest:
        """The request (a big body is parsed in a worker thread: post.off_loop)."""
        config = app.server_config
        return await off_loop(len(body), parse_chat_batch, body, config.limits, None,
                              engine_info, config.tool_call_parser)

    @staticmethod
    async def write(app, answer, stream, req: GenerateRequest, response_id: str,
                    model: str, direct=None) -> None:
        """The whole answer (``direct``, the connection's writes without a task: unused)."""
        await write_full(answer, stream, req, response_id, model,
                         app.server_config.reasoning_parser)


ROUTE = ChatBatchRoute()
