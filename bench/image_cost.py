#!/usr/bin/env python3
"""The per-request cost of an image: fetched by the frontend, decoded and processed by the
worker (issue 46), as wall and CPU milliseconds per image, stage by stage.

What it measures
----------------
Photo-like pictures made here (gradients, shapes, noise), 512 x 512 and 1024 x 1024 by
default, each as a JPEG (quality 90) and a PNG. Each stage runs the production code, one
image a request, ``--repeat`` times after one warm-up; the median of each is printed.

The frontend's share, in this process (a Trio program, as the frontend runs it):

- ``parse``: the chat body parsed and checked (``server.openai.schema.parse_chat``, in a
  thread past 256 KiB as the route does it): its cost is the data: URL's, the body's text
  being a few words;
- ``fetch``: ``server.http.images.fetch_images`` with the real fetcher (``MediaFetcher``),
  over an http URL served by ``python -m http.server`` on loopback (another process: its
  CPU is not counted), allowed by the policy's options (``allowed_domains`` 127.0.0.1,
  ``allow_private_addresses``); and over the same image as a data: URL (base64 decoded);
  either way sniffed and hashed;
- ``SUBMIT frame``: the frame that carries the image to the worker, encoded (the
  frontend's half) and decoded with its shape checked (the worker's half).

The worker's share, in this process, as ``VLLMEngine._prepare_images`` runs it:

- ``decode``: ``server.engines.vllm.images.decode_images`` (PIL: the header's pixel bound,
  then the pixels, converted to RGB);
- ``process``: vLLM's renderer, ``render_cmpl(..., skip_mm_cache=True)`` on the ids of the
  chat template with one placeholder, as the engine calls it: the model's own processor
  resizes and normalizes the image and the placeholder is expanded. The renderer is built
  as ``LLMEngine`` builds it (``vllm.renderers.renderer_from_config`` on the engine
  config), without loading weights, which take no part in it. The model is
  tests/tiny_vlm.py's tiny Idefics3 (64 x 64 pixels an image, 19 tokens), or
  ``--model-path``: a real model's processor does more (Idefics3 splits an image into
  tiles of 364 pixels; Qwen2.5-VL keeps its resolution).

End to end (not with ``--smoke`` or ``--no-server``): ``python -m server --engine vllm`` on
the same model, and ``--requests`` one-token chat requests (not streamed, temperature 0,
the openai SDK) per case: without an image, and with each image as a data: URL and as an
http URL, the cases interleaved. The median latency is the request's time to first token;
the difference to the text-only case is the image's share, the vision encoder included.

CPU is the process's (``time.process_time``: every thread, the fetcher's hashing thread and
the processor's torch threads included). Figures move with the machine's load: the last
line of stdout is one JSON object with every figure and the load average.

Usage::

    python bench/image_cost.py [--sizes 512,1024] [--repeat 20] [--requests 10]
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bench.loadgen_lib import smoke  # noqa: E402

#: Formats made, each with its file name's extension (http.server's Content-Type).
FORMATS = {"jpeg": "jpg", "png": "png"}
MODEL = "tiny-vlm"
TEXT = "What is in this picture?"
STARTUP = 900  # seconds: a bound on the end-to-end server's start (vLLM loads in minutes)


# -- the images ----------------------------------------------------------------------------

def photo(side: int):
    """A photo-like RGB picture, the same every run: smooth gradients, a few soft shapes and
    sensor-like noise, so that JPEG and PNG compress it about as they do a photo."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(side)
    ramp = Image.linear_gradient("L").resize((side, side))
    image = Image.merge("RGB", (ramp, Image.radial_gradient("L").resize((side, side)),
                                ramp.rotate(90)))
    draw = ImageDraw.Draw(image)
    for _ in range(16):
        x, y = rng.randrange(side), rng.randrange(side)
        r = rng.randrange(side // 16, side // 4)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in "rgb"))
    image = image.filter(ImageFilter.GaussianBlur(side / 128))
    noise = Image.merge("RGB", [Image.effect_noise((side, side), 40) for _ in "rgb"])
    return Image.blend(image, noise, 0.12)


def make_images(sizes: list[int], directory: Path) -> list[dict]:
    """Each size in each format: ``{"name", "file", "data", "media_type", "side"}``; the
    files written to ``directory`` (what the loopback server serves)."""
    images = []
    for side in sizes:
        picture = photo(side)
        for fmt, ext in FORMATS.items():
            buf = io.BytesIO()
            picture.save(buf, format=fmt.upper(), **({"quality": 90} if fmt == "jpeg" else {}))
            name = f"{fmt.upper()} {side}x{side}"
            file = f"photo{side}.{ext}"
            (directory / file).write_bytes(buf.getvalue())
            images.append({"name": name, "file": file, "data": buf.getvalue(),
                           "media_type": f"image/{fmt}", "side": side})
    return images


def data_url(image: dict) -> str:
    return f"data:{image['media_type']};base64," + base64.b64encode(image["data"]).decode()


def content(url: str | None) -> list[dict]:
    """A user message's content: the text, and the image at ``url`` when given."""
    parts: list[dict] = [{"type": "text", "text": TEXT}]
    if url is not None:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


class ImageServer:
    """``python -m http.server`` on 127.0.0.1, serving ``directory`` (a process of its own:
    its CPU is not the frontend's)."""

    def __init__(self, directory: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
             "--directory", str(directory)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"port (\d+)", line)
        if match is None:
            self.close()
            raise RuntimeError(f"http.server did not say its port: {line!r}")
        self.url = f"http://127.0.0.1:{match[1]}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# -- timing --------------------------------------------------------------------------------

class Stage:
    """One stage's samples for one image: wall and CPU seconds per run."""

    def __init__(self, part: str, stage: str, image: str):
        self.part, self.stage, self.image = part, stage, image
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    def row(self) -> dict:
        return {"part": self.part, "stage": self.stage, "image": self.image,
                "wall_ms": round(statistics.median(self.wall) * 1e3, 3),
                "cpu_ms": round(statistics.median(self.cpu) * 1e3, 3), "runs": len(self.wall)}


def timed(stage: Stage | None, fn, *args):
    """``fn(*args)``, its wall and CPU time added to ``stage`` (None: a warm-up)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    if stage is not None:
        stage.add(time.perf_counter() - wall, time.process_time() - cpu)
    return result


async def timed_async(stage: Stage | None, fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    result = await fn(*args)
    if stage is not None:
        stage.add(time.perf_counter() - wall, time.process_time() - cpu)
    return result


# -- the frontend's share ------------------------------------------------------------------

async def frontend(images: list[dict], base_url: str, repeat: int) -> list[dict]:
    """Parse, fetch and frame of each image, over http and as a data: URL (see the module
    docstring)."""
    from server.config import Limits
    from server.http.images import fetch_images
    from server.http.post import off_loop
    from server.media import MediaFetcher, MediaPolicy
    from server.openai import schema
    from server.worker_protocol import wire

    fetcher = MediaFetcher(MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}),
                                       allow_private_addresses=True))
    info = {"images": {"per_prompt": 1}}  # (the HELLO of a model that takes one image)
    rows = []
    for image in images:
        for source, url in (("http", f"{base_url}/{image['file']}"), ("data:", data_url(image))):
            body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": content(url)}]}).encode()
            stages = {name: Stage("frontend", f"{name} ({source})", image["name"])
                      for name in ("parse", "fetch")}
            stages["frame"] = Stage("both", "SUBMIT frame", image["name"])
            for run in range(repeat + 1):  # (the first: a warm-up, not counted)
                timing = stages if run else dict.fromkeys(stages)
                req = await timed_async(timing["parse"], off_loop, len(body),
                                        schema.parse_chat, body, Limits(), None, info)
                fetched = await timed_async(timing["fetch"], fetch_images, fetcher,
                                            req.prompts)
                assert fetched == 1, fetched
                submit = wire.Submit(run + 1, req.prompts[0], req.params.to_wire())
                frame = timed(timing["frame"], _frame, submit)
            if source == "http":  # (its body is the text's: the parse is no image's cost)
                rows.append(stages["fetch"].row())
            else:  # (the same frame either way: once)
                rows += [stages["parse"].row(), stages["fetch"].row(),
                         {**stages["frame"].row(), "bytes": len(frame)}]
    return rows


def _frame(submit) -> bytes:
    """``submit`` encoded as the frontend sends it, and decoded as the worker reads it."""
    from server.worker_protocol import wire

    frame = wire.encode(submit)
    [got] = wire.FrameDecoder(wire.REQUESTS).feed(frame)
    assert got.rid == submit.rid
    return frame


# -- the worker's share --------------------------------------------------------------------

def import_vllm() -> None:
    """Import vLLM as the worker does: its environment, and torchvision hidden where it
    cannot load beside vLLM's CPU torch."""
    from server.engines.vllm.engine import ENVIRONMENT, _torchvision_guard

    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    _torchvision_guard()
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.renderers  # noqa: F401


def renderer_of(model_path: str):
    """vLLM's renderer for ``model_path``, built as ``LLMEngine`` builds it (no weights)."""
    import_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config

    config = EngineArgs(model=model_path, dtype="float32", max_model_len=1024,
                        enforce_eager=True, limit_mm_per_prompt={"image": 1}
                        ).create_engine_config()
    return renderer_from_config(config)


def worker(images: list[dict], model_path: str, repeat: int) -> list[dict]:
    """Decode and vLLM's processing of each image, as the vllm engine prepares a prompt."""
    from server.engines.vllm.images import decode_images, split_images
    from server.workers.base import encode_prompt

    renderer = renderer_of(model_path)
    # (as the engine calls it: server.engines.vllm.engine, VLLMEngine._prepare_images)
    render = functools.partial(renderer.render_cmpl, skip_mm_cache=True)
    tokenizer = renderer.get_tokenizer()
    vocab_size = len(tokenizer)
    text_ids = encode_prompt({"messages": [{"role": "user", "content": content(None)}]},
                             tokenizer, vocab_size=vocab_size, chat=True, model=MODEL)
    rows = []
    for image in images:
        # (the wire part the frontend sends: server.openai.images.wire_image)
        prompt = {"messages": [{"role": "user", "content": [
            *content(None), {"type": "image", "data": image["data"], "sha256": ""}]}]}
        rendered, parts = split_images(prompt)
        ids = encode_prompt(rendered, tokenizer, vocab_size=vocab_size, chat=True, model=MODEL)
        decode = Stage("worker", "decode", image["name"])
        process = Stage("worker", "process", image["name"])
        for run in range(repeat + 1):  # (the first: a warm-up)
            pictures = timed(decode if run else None, decode_images, parts)
            [engine_input] = timed(
                process if run else None, render,
                [{"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}])
        tokens = len(engine_input["prompt_token_ids"]) - len(text_ids)
        rows += [decode.row(), {**process.row(), "image_tokens": tokens}]
    return rows


# -- end to end ----------------------------------------------------------------------------

def end_to_end(images: list[dict], model_path: str, base_url: str, requests: int) -> list[dict]:
    """Median latency of one-token chat requests without and with each image, through
    ``python -m server --engine vllm`` (see the module docstring)."""
    import httpx
    import openai

    from bench.loadgen_lib.spawn import SpawnedServer

    args = ["--engine", "vllm", "--model-path", model_path, "--max-model-len", "1024",
            "--dtype", "float32", "--engine-arg", "kv_cache_memory_bytes=67108864",
            "--enforce-eager", "--limit-mm-per-prompt", '{"image": 1}',
            "--served-model-name", MODEL, "--disable-log-requests",
            "--allowed-media-domains", "127.0.0.1", "--allow-private-media-addresses"]
    srv = SpawnedServer(shlex.join(args), "server", None)
    try:
        trio.run(srv.wait_healthy, float(STARTUP))
        deadline = time.monotonic() + STARTUP
        while httpx.get(srv.url + "/ready", timeout=30).status_code != 200:
            if time.monotonic() > deadline or srv.proc.poll() is not None:
                raise RuntimeError("the server did not get ready:\n" + srv.log_tail())
            time.sleep(0.5)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
        cases = {"no image": content(None)}
        for image in images:
            cases[f"{image['name']} (data:)"] = content(data_url(image))
            cases[f"{image['name']} (http)"] = content(f"{base_url}/{image['file']}")
        times: dict[str, list[float]] = {case: [] for case in cases}
        for run in range(requests + 1):  # (the first round: a warm-up)
            for case, parts in cases.items():
                start = time.perf_counter()
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": parts}],
                    max_tokens=1, temperature=0)
                if run:
                    times[case].append(time.perf_counter() - start)
    except BaseException:
        print(srv.log_tail(), file=sys.stderr)
        raise
    finally:
        srv.stop()
    base = statistics.median(times["no image"])
    return [{"part": "end to end", "stage": "one-token request", "image": case,
             "wall_ms": round(statistics.median(t) * 1e3, 2),
             "added_ms": round((statistics.median(t) - base) * 1e3, 2), "runs": len(t)}
            for case, t in times.items()]


# -- the report ----------------------------------------------------------------------------

def show(rows: list[dict]) -> None:
    print(f"{'part':<10} {'stage':<24} {'image':<24} {'wall ms':>9} {'CPU ms':>9}  notes")
    for row in rows:
        notes = []
        if "bytes" in row:
            notes.append(f"{row['bytes']} bytes")
        if "image_tokens" in row:
            notes.append(f"{row['image_tokens']} image tokens")
        if "added_ms" in row:
            notes.append(f"{row['added_ms']:+.2f} ms against no image")
        cpu = f"{row['cpu_ms']:>9.3f}" if "cpu_ms" in row else f"{'':>9}"
        print(f"{row['part']:<10} {row['stage']:<24} {row['image']:<24} "
              f"{row['wall_ms']:>9.3f} {cpu}  {', '.join(notes)}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,1024",
                   help="square images' sides in pixels, comma-separated (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=20, help="runs of each stage per image")
    p.add_argument("--requests", type=int, default=10,
                   help="end to end: requests per case")
    p.add_argument("--model-path", help="a vision model's directory (default: the tests' "
                   "tiny Idefics3, built here)")
    p.add_argument("--no-server", action="store_true", help="skip the end-to-end run")
    args = smoke.parse_args(p, argv, sizes="96", repeat=2, no_server=True)
    if args.smoke:
        smoke.skipped("the end-to-end server (vLLM loads in minutes)")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "images"
        directory.mkdir()
        model_path = args.model_path
        if model_path is None:
            from tests.tiny_vlm import build_tiny_vlm

            import_vllm()  # (first: the build then shares its imports, torch and transformers)
            model_path = str(build_tiny_vlm(Path(tmp) / "tiny-idefics3"))
        images = make_images(sizes, directory)
        served = ImageServer(directory)
        load = [round(x, 2) for x in os.getloadavg()]
        try:
            rows = trio.run(frontend, images, served.url, args.repeat)
            rows += worker(images, model_path, args.repeat)
            show(rows)
            if not args.no_server:
                ends = end_to_end(images, model_path, served.url, args.requests)
                show(ends)
                rows += ends
        finally:
            served.close()
    sizes_bytes = {image["name"]: len(image["data"]) for image in images}
    print(json.dumps({"images": sizes_bytes, "load_before": load,
                      "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
