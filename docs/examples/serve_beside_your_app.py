"""Serving the OpenAI routes inside your own Trio program, beside your own app.

Run it from the project root:  python docs/examples/serve_beside_your_app.py

One engine (two sim workers) is shared by two HTTP servers in one ``trio.run``:

* the OpenAI-compatible routes (``server.serve``, on a port of their own), and
* the program's own ASGI app (here a few lines of raw ASGI served by hypercorn; a Quart or
  Starlette app works the same), whose ``/summary`` route calls the engine directly.

The program makes a request to each, then leaves its nursery by cancelling it: both
servers stop, and the engine's workers with them. Nothing process-wide is touched: no
signal handler, no change to the garbage collector, no hypercorn class replaced (the
program's own app keeps hypercorn's behaviour).
"""

import functools
import json

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

import server


def my_app(engine: server.Engine):
    """The program's own ASGI app: ``GET /summary`` answers from the shared engine."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        text = ""
        params = server.SamplingParams(max_tokens=5, seed=7)
        try:
            async with engine.generate("Summarise the news", params) as stream:
                async for out in stream:
                    text += out.text
            status, body = 200, {"summary": text}
        except server.ServerError as exc:  # a failed request raises its error
            status, body = exc.status, {"error": exc.message}
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})

    return app


async def main() -> None:
    config = server.ServerConfig(
        engine=server.EngineConfig(workers=2, engine_options={"itl_ms": 2.0}),
        host="127.0.0.1",
        port=0,  # any free port; serve() reports the URL
    )
    async with server.open_engine(config.engine) as engine:
        async with trio.open_nursery() as nursery:
            # The OpenAI routes, on the engine the program already runs.
            llm_app = server.create_app(config, engine=engine)
            llm_urls = await nursery.start(functools.partial(server.serve, config, app=llm_app))
            # The program's own app, beside it.
            hc = HypercornConfig()
            hc.bind = ["127.0.0.1:0"]
            hc.accesslog = None
            my_urls = await nursery.start(functools.partial(hypercorn_serve, my_app(engine), hc))

            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(
                    llm_urls[0] + "/v1/completions",
                    json={"model": "sim", "prompt": "Hello", "max_tokens": 4},
                )
                print("openai route:", r.status_code, repr(r.json()["choices"][0]["text"]))
                r = await http.get(my_urls[0] + "/summary")
                print("own route:", r.status_code, r.json())

            # Leaving: cancel the scope. Both servers stop at once (for a graceful drain of
            # requests in flight, pass serve() a shutdown_trigger event and set it instead).
            nursery.cancel_scope.cancel()
        print("servers stopped; workers alive:", engine.statistics().workers_alive)
    print("engine stopped; workers alive:", engine.statistics().workers_alive)


if __name__ == "__main__":
    trio.run(main)
