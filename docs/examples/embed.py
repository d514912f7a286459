"""Embedding the engine in a Trio program, without HTTP.

Run it from the project root:  python docs/examples/embed.py

It starts two sim workers, runs a batch of three prompts with n=2 (six choices, index
prompt_index * 2 + sample), then starts a long request and cancels it after 50 ms: the
engine request is aborted and the workers end up idle.
"""

import trio

import server


async def main() -> None:
    config = server.EngineConfig(workers=2, engine_options={"itl_ms": 5.0})
    async with server.open_engine(config) as engine:
        params = server.SamplingParams(max_tokens=6, n=2, seed=1)
        texts: dict[int, str] = {}
        async with engine.generate_many(["one", "two", "three"], params) as stream:
            async for out in stream:
                texts[out.index] = texts.get(out.index, "") + out.text
                if out.finished:
                    print(f"choice {out.index}: {texts[out.index]!r} ({out.finish_reason})")

        with trio.move_on_after(0.05):
            async with engine.generate("a long one", server.SamplingParams(max_tokens=5_000)) as s:
                async for _ in s:
                    pass
        print("after cancelling:", await engine.ping_all(), "(running, waiting) per worker")


if __name__ == "__main__":
    trio.run(main)
