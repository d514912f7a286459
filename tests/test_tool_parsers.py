"""The tool call parsers (sans-IO): every way of cutting an output into deltas gives the
same content and calls as the whole text, nothing of a call leaks into content, and the
argument fragments concatenate to exactly the final arguments."""

from __future__ import annotations

import json
import math
import random

import pytest

from server.openai.tool_parsers import ToolCallParser, accumulate, parse_text

W = '{"city": "Pa}ris \\"x\\" 日本 🙂", "days": [1, {"n": 2}], "ok": true}'

#: (format, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
     None, [("get_weather", W)]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name":"b","arguments":{"x":"<tool_call>"}}</tool_call>\n',
     "Let me check.", [("a", "{}"), ("b", '{"x":"<tool_call>"}')]),
    ("hermes", "No calls: 1 < 2 and <tool_call> is just text </tool_call>.",
     "No calls: 1 < 2 and <tool_call> is just text </tool_call>.", []),
    ("hermes", '<tool_call>{"arguments": {}, "name": "f"}</tool_call> after',
     '<tool_call>{"arguments": {}, "name": "f"}</tool_call> after', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "unfinished', None,
     [("f", '{"a": "unfinished')]),
    ("hermes", 'text <tool_ca', "text <tool_ca", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": 1}, "extra": {"}": 2}}</tool_call>'
     'Done.  ', "Done.", [("f", '{"q": 1}')]),
    ("hermes", '  plain answer  ', "  plain answer  ", []),
    ("hermes", 'A \n<tool_call>{"name": "f", "arguments": {}}</tool_call> B', "A B",
     [("f", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
     f'{{"name": "g", "parameters": {W}}}', None, [("f", '{"x": 1}'), ("g", W)]),
    ("llama3_json", ' {"name": "f", "parameters": {}}', None, [("f", "{}")]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '{"value": 3}', '{"value": 3}', []),
    ("llama3_json", '{"name": "f", "parameters": {}} and then text', "and then text",
     [("f", "{}")]),
    ("llama3_json", "<|python", "<|python", []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "f", "arguments": {W}}}, {{"name": "g", '
     '"arguments": {}}]', None, [("f", W), ("g", "{}")]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name":"f","arguments":{"a":"[TOOL_CALLS]"}}]',
     "Checking.", [("f", '{"a":"[TOOL_CALLS]"}')]),
    ("mistral", "A plain answer with [brackets] and [TOOL_CALL",
     "A plain answer with [brackets] and [TOOL_CALL", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', []),  # the v11 form: not parsed
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": "unfinished', None,
     [("f", '{"x": "unfinished')]),
    ("forced", f'[{{"name": "f", "arguments": {W}}}, {{"name": "g", "arguments": {{}}}}]',
     None, [("f", W), ("g", "{}")]),
    ("forced", '[{"name":"f","arguments":{"a":[{"b":"}"}]}}]', None,
     [("f", '{"a":[{"b":"}"}]}')]),
    ("forced", '[{"name":"f","arguments":{}},{"name":"g","arg', None, [("f", "{}")]),
]


def parse_pieces(fmt: str, pieces: list[str], parallel: bool = True):
    """(content or None, [(name, arguments)]) from feeding ``pieces``; checks each delta's
    shape on the way."""
    p = ToolCallParser(fmt, parallel=parallel)
    content = ""
    calls: list[dict] = []
    started = 0
    for piece in [*pieces, None]:
        said, deltas = p.feed(piece) if piece is not None else p.finish()
        content += said
        for d in deltas:
            if "id" in d:
                assert d["index"] == started and d["type"] == "function"
                started += 1
                assert d["id"].startswith("call_") and d["function"]["arguments"] == ""
            else:
                assert set(d) == {"index", "function"} and d["function"]["arguments"]
                assert d["index"] == started - 1
        accumulate(calls, deltas)
    assert p.calls >= len(calls)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return (content or None) if calls else content, got


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_every_split_gives_the_whole_texts_parse(fmt, text, content, calls):
    whole_content, whole_calls = parse_text(fmt, text)
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls
    expected = (content, calls)
    assert parse_pieces(fmt, [text]) == expected
    assert parse_pieces(fmt, list(text)) == expected  # character by character
    for cut in range(len(text) + 1):
        assert parse_pieces(fmt, [text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert parse_pieces(fmt, pieces) == expected, pieces


def test_complete_arguments_parse_as_json():
    for _, _, _, calls in CASES:
        for _, arguments in calls:
            if "unfinished" not in arguments:
                json.loads(arguments)


def test_nothing_of_a_call_is_released_early():
    p = ToolCallParser("hermes")
    assert p.feed("Hi <tool") == ("Hi", [])  # the blank and a possible tag held back
    assert p.feed("_call>") == ("", [])
    said, deltas = p.feed('{"name": "f", "arguments": {"a"')
    assert said == "" and deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"a"'}}
    assert p.feed(": 1}}</tool_c") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert p.feed("all>") == ("", [])
    assert p.finish() == ("", [])


def test_parallel_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    content, calls = parse_text("hermes", text, parallel=False)
    assert content is None and [c["function"]["name"] for c in calls] == ["a"]
    for cut in range(len(text) + 1):
        assert parse_pieces("hermes", [text[:cut], text[cut:]], parallel=False) == (
            None, [("a", "{}")])


def test_unknown_format():
    with pytest.raises(ValueError):
        ToolCallParser("qwen3_coder")


def test_reasoning_then_tool_calls_in_the_events_of_a_stream():
    """With --reasoning-parser and tools, the thinking is split off first and the parser
    sees only the content; the events' deltas add up to the whole answer's split."""
    from server.openai.encode import ChunkEncoder
    from server.openai.events import RichEvents
    from server.openai.tools import read_tools
    from server.outputs import RequestOutput

    tools = read_tools({"tools": [{"type": "function", "function": {"name": "f"}}]}, "hermes")
    text = ('<think>I should call <tool_call> f.</think>Calling.\n<tool_call>{"name": "f", '
            '"arguments": {"q": "日本"}}</tool_call>')
    for cut in range(0, len(text) + 1, 3):
        enc = ChunkEncoder(chat=True, response_id="x", created=0, model="m")
        rich = RichEvents(enc, choices=1, chat=True, logprobs=False, reasoning_parser="qwen3",
                          tools=tools)
        events = b""
        for piece, finish in ((text[:cut], None), (text[cut:], "stop")):
            events += rich.event(RequestOutput(0, piece, 1, 3, 1, finish)) or b""
        thought, said, calls, finishes = "", "", [], []
        for line in events.decode().split("\n\n")[:-1]:
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            delta = choice["delta"]
            thought += delta.get("reasoning_content", "")
            said += delta.get("content", "")
            accumulate(calls, delta.get("tool_calls", []))
            finishes.append(choice["finish_reason"])
        assert thought == "I should call <tool_call> f." and said == "Calling.", cut
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"q": "日本"}')], cut
        assert finishes[-1] == "tool_calls" and finishes[:-1] == [None] * (len(finishes) - 1)


@pytest.mark.parametrize("fmt, opening, filler", [
    ("hermes", "Hi <tool_call>{", " "),  # a head kept open by blanks
    ("hermes", "<tool_call>\n", "\n"),  # blanks before the call's "{"
    ("hermes", '<tool_call>{"name": "', "\\\\"),  # a name of escapes
    ("llama3_json", "", " "),  # blanks that open the answer
    ("llama3_json", '{"name"', " "),
    ("mistral", "[TOOL_CALLS]", " "),  # blanks before the array
])
def test_text_that_keeps_a_call_undecided_costs_linear_time(fmt, opening, filler):
    """One token at a time, a model can keep a call's head undecided for ever; the parser
    must not scan the whole of it again at every delta (that was seconds of event loop
    for 8,000 tokens). Past MAX_HEAD the text is content, for any split."""
    from server.openai.tool_parsers import MAX_HEAD

    pieces = [opening] + [filler] * 8000 + ["done"]
    content, calls = parse_pieces(fmt, pieces)
    assert (content, calls) == parse_text(fmt, "".join(pieces))
    assert calls == [] and content is not None and content.endswith("done")
    assert_linear(lambda n: parse_pieces(fmt, [opening] + [filler] * n + ["done"]))
    assert len(opening) + len(filler) * 1500 > MAX_HEAD  # (the smaller run's too)


@pytest.mark.parametrize("fmt, call", [
    ("llama3_json", '{"name": "f", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}'),
])
def test_blanks_between_calls_cost_linear_time(fmt, call):
    pieces = [call] + [" "] * 8000 + ["done"]
    got = parse_pieces(fmt, pieces)
    assert got == (parse_text(fmt, "".join(pieces))[0], [("f", "{}")])
    assert_linear(lambda n: parse_pieces(fmt, [call] + [" "] * n + ["done"]))


def assert_linear(run, n: int = 1500) -> None:
    """``run(8 * n)`` costs about 8 times ``run(n)`` (CPU time, best of 3 each, in this
    process), not 64 times: linear, not quadratic. A ratio of two runs on the same busy
    machine, not a bound in seconds (no wall-clock bounds in tests); a busy machine was
    seen to stretch a linear 4x to 8.6x, hence the wide margin, and three tries."""
    import time

    def cost(size: int) -> float:
        best = math.inf
        for _ in range(3):
            started = time.process_time()
            run(size)
            best = min(best, time.process_time() - started)
        return best

    seen = []
    for _ in range(3):  # a load spike can stretch one pair; a quadratic cost stretches every one
        small, large = cost(n), cost(8 * n)
        if large < 24 * small:  # linear: about 8; quadratic: about 64
            return
        seen.append((small, large))
    raise AssertionError(f"not linear in three tries: {seen}")
