"""What one worker frame costs to encode and to decode (with its shape checked), in
microseconds per frame (issue 43 item 6, issue 47: a STEP frame is encoded by the worker
and decoded by the frontend's router every engine step, for every worker; a SUBMIT once
a request).

Cases: a STEP of one output row (one stream), of 16 rows (a batch), of 16 rows with a
``token_ids`` note each (what a request sends with migration on), and a SUBMIT of a chat
prompt with typical params. Encoding is the sender's ``wire.encode``; decoding is the
receiver's ``FrameDecoder.feed`` with the receiver's shape check (the frontend's for a
STEP, a worker's for a SUBMIT), so a frame that passes is a frame the router may read.

Usage: ``python bench/wire_codec.py [--rounds 5] [--frames 20000]``; the best round is
printed per case. Figures vary with the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import time

from loadgen_lib import smoke
from server.worker_protocol import wire


def _step(rows: int, notes: bool) -> wire.Step:
    outputs = [wire.OutputRow(100 + i, " the", 1, None, None) for i in range(rows)]
    if not notes:
        return wire.Step([], outputs)
    return wire.Step([], outputs, [wire.NoteRow(100 + i, wire.Note(token_ids=[279]))
                                   for i in range(rows)])


def _submit() -> wire.Submit:
    prompt = {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about the sea, please."},
    ]}
    params = {"max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "seed": None,
              "stop": ["\n\n"], "ignore_eos": False, "n": 1, "logprobs": None,
              "token_ids": True, "error_param": True}
    return wire.Submit(4711, prompt, params)


CASES = {
    "STEP, 1 output row": (lambda: _step(1, False), wire.REPLIES),
    "STEP, 16 output rows": (lambda: _step(16, False), wire.REPLIES),
    "STEP, 16 rows + 16 token_ids notes": (lambda: _step(16, True), wire.REPLIES),
    "SUBMIT, chat prompt": (_submit, wire.REQUESTS),
}


def _read(decoder: wire.FrameDecoder, frame: bytes) -> None:
    """Decode ``frame`` as its receiver does: typed, and a STEP's rows and notes checked
    as the router checks them while it routes them (:func:`wire.final_ok`,
    :func:`wire.note_ok`)."""
    unset = wire.UNSET
    for message in decoder.feed(frame):
        if type(message) is wire.Step:
            if message.notes is not unset:
                for rid, note in message.notes:
                    if (rid is None or note.logprobs is not unset or note.kv_events
                            is not unset or note.routed is not unset
                            or note.prompt_logprobs is not unset) and not (
                                wire.note_ok(rid, note)):
                        raise wire.malformed(message)
            for _, _, _, finish, err in message.outputs:
                if err is not None if finish is None else not wire.final_ok(finish, err):
                    raise wire.malformed(message)


def _best(fn, frames: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(frames):
            fn()
        best = min(best, (time.perf_counter() - start) / frames)
    return best * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=20000)
    args = smoke.parse_args(parser, argv, rounds=1, frames=200)
    print(f"{'frame':<38} {'bytes':>6} {'encode us':>10} {'decode us':>10} {'both us':>8}")
    for name, (build, accepted) in CASES.items():
        message = build()
        frame = wire.encode(message)
        decoder = wire.FrameDecoder(accepted)
        (decoded,) = decoder.feed(frame)
        assert wire.as_list(decoded) == wire.as_list(message), name  # (the same message)
        encode_us = _best(functools.partial(wire.encode, message), args.frames, args.rounds)
        decode_us = _best(functools.partial(_read, decoder, frame), args.frames, args.rounds)
        print(f"{name:<38} {len(frame) - 4:>6} {encode_us:>10.2f} {decode_us:>10.2f} "
              f"{encode_us + decode_us:>8.2f}")


if __name__ == "__main__":
    main()
