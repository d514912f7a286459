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

The worker's share, in this process: the steps of ``VLLMEngine._prepare_images`` (vLLM
0.32's path; keep in step with it), each timed, for an image new to vLLM's caches (a
variant of its own each run) and for the same image again:

- ``sha256 check``: ``server.engines.vllm.images.image_digests``, the image's SHA-256
  (vLLM's key for it) checked against its bytes;
- ``decode``: ``decode_images`` (PIL: the header's pixel bound, then the pixels,
  converted to RGB); again, an image vLLM's processor cache holds (``processed_images``)
  has its header read, not its pixels;
- ``process``: vLLM's renderer, ``render_cmpl(..., skip_mm_cache=True)`` with the images'
  SHA-256 as their uuids, on the ids of the chat template with one placeholder, as the
  engine calls it: the model's own processor resizes and normalizes the image and the
  placeholder is expanded; again, the processed form comes from vLLM's cache. The
  renderer is built as ``LLMEngine`` builds it (``vllm.renderers.renderer_from_config`` on
  the engine config), without weights, which take no part in it. The model is
  tests/tiny_vlm.py's tiny Idefics3 (64 x 64 pixels an image, 19 tokens), or
  ``--model-path``: a real model's processor does more (Idefics3's resizes an image to
  tiles of 364 pixels and splits it; Qwen2.5-VL's keeps about its resolution).

End to end (not with ``--smoke`` or ``--no-server``): ``python -m server --engine vllm`` on
the same model, and ``--requests`` one-token chat requests (not streamed, temperature 0,
the openai SDK) per case: without an image; with each image new (a variant of its own each
request) as an http URL and as a data: URL; and the same data: URL each time (in vLLM's
caches after the first). The cases are interleaved, a first round not counted. The median
latency is the request's time to first token; the difference to the text-only case is the
image's share, the client's encoding and sending of the body and the vision encoder
included.

CPU is the process's (``time.process_time``: every thread, the fetcher's hashing thread and
the processor's torch threads included). Figures move with the machine's load: the last
line of stdout is one JSON object with every figure and the load average.

Usage::

    python bench/image_cost.py [--sizes 512,1024] [--repeat 20] [--requests 10]

``--smoke``: 96 x 96 images, two runs a stage, no server (vLLM is imported and its
renderer built, no engine: about 25 s of one core, most of it vLLM's imports).
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
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
import types
from collections.abc import Callable
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


class Picture:
    """One test image, a size in a format, and its variants: the same picture with the
    variant's number drawn in its corner (``variant`` > 0), each new to vLLM's caches, which
    key an image by its bytes' SHA-256. Files are written to ``directory`` (the loopback
    server's) as asked."""

    def __init__(self, picture, side: int, fmt: str, directory: Path):
        self.name = f"{fmt.upper()} {side}x{side}"
        self.media_type = f"image/{fmt}"
        self._picture, self._fmt, self._directory = picture, fmt, directory

    def data(self, variant: int = 0) -> bytes:
        picture = self._picture
        if variant:  # (its 16 bits as black and white 8 x 8 blocks: JPEG keeps them apart)
            from PIL import ImageDraw

            picture = picture.copy()
            draw = ImageDraw.Draw(picture)
            for bit in range(16):
                x, y = 8 * (bit % 8), 8 * (bit // 8)
                draw.rectangle((x, y, x + 7, y + 7),
                               fill=(255, 255, 255) if variant >> bit & 1 else (0, 0, 0))
        buf = io.BytesIO()
        picture.save(buf, format=self._fmt.upper(),
                     **({"quality": 90} if self._fmt == "jpeg" else {}))
        return buf.getvalue()

    def url(self, base_url: str, variant: int = 0) -> str:
        name = f"{self.name.replace(' ', '-')}-{variant}.{FORMATS[self._fmt]}"
        if not (self._directory / name).exists():
            (self._directory / name).write_bytes(self.data(variant))
        return f"{base_url}/{name}"

    def data_url(self, variant: int = 0) -> str:
        return f"data:{self.media_type};base64," + base64.b64encode(self.data(variant)).decode()


def make_pictures(sizes: list[int], directory: Path) -> list[Picture]:
    """Each size in each format."""
    return [Picture(picture, side, fmt, directory)
            for side in sizes for picture in [photo(side)] for fmt in FORMATS]


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

async def frontend(pictures: list[Picture], base_url: str, repeat: int) -> list[dict]:
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
    for picture in pictures:
        for source, url in (("http", picture.url(base_url)), ("data:", picture.data_url())):
            body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": content(url)}]}).encode()
            stages = {name: Stage("frontend", f"{name} ({source})", picture.name)
                      for name in ("parse", "fetch")}
            stages["frame"] = Stage("both", "SUBMIT frame", picture.name)
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


def worker(pictures: list[Picture], model_path: str, repeat: int) -> list[dict]:
    """The worker's preparation of each image, new to vLLM's caches and again (the
    module docstring): the steps of ``VLLMEngine._prepare_images``, each timed."""
    from server.engines.vllm.images import decode_images, image_digests, split_images
    from server.engines.vllm.private_api import processed_images
    from server.openai.images import wire_image
    from server.workers.base import encode_prompt

    renderer = renderer_of(model_path)
    # (what the engine asks its LLMEngine: whether vLLM's processor cache holds an image)
    held = processed_images(types.SimpleNamespace(renderer=renderer))
    tokenizer = renderer.get_tokenizer()

    def ids_of(prompt: dict) -> list[int]:
        return encode_prompt(prompt, tokenizer, vocab_size=len(tokenizer), chat=True,
                             model=MODEL)

    text_ids = ids_of({"messages": [{"role": "user", "content": content(None)}]})

    def prepare(prompt: dict, timing: dict, again: bool) -> tuple[int, set[int]]:
        """The image tokens, and which images were not decompressed (held by vLLM)."""
        rendered, parts = split_images(prompt)
        digests = timed(None if again else timing["sha256 check"], image_digests, prompt)
        ids = ids_of(rendered)
        processed = {k for k, d in enumerate(digests) if held is not None and held(d)}
        suffix = " (again)" if again else ""
        images = timed(timing["decode" + suffix],
                       functools.partial(decode_images, skip=processed), parts)
        [engine_input] = timed(timing["process" + suffix], functools.partial(
            renderer.render_cmpl, skip_mm_cache=True),
            [{"prompt_token_ids": ids, "multi_modal_data": {"image": images},
              "multi_modal_uuids": {"image": digests}}])
        return len(engine_input["prompt_token_ids"]) - len(text_ids), processed

    rows = []
    for picture in pictures:
        stages = {name: Stage("worker", name, picture.name) for name in (
            "sha256 check", "decode", "process", "decode (again)", "process (again)")}
        for run in range(repeat + 1):  # (the first: a warm-up, not counted)
            timing = stages if run else dict.fromkeys(stages)
            data = picture.data(1 + run)  # (new to vLLM's caches)
            prompt = {"messages": [{"role": "user", "content": [
                *content(None), wire_image(data, hashlib.sha256(data).hexdigest())]}]}
            tokens, skipped = prepare(prompt, timing, again=False)
            assert not skipped, "a new image was found in vLLM's cache"
            tokens_again, skipped = prepare(prompt, timing, again=True)
            assert tokens_again == tokens
        note = ("header read, not decompressed" if skipped
                else "decompressed: this vLLM has no processor cache to look in")
        rows += [stages["sha256 check"].row(), stages["decode"].row(),
                 {**stages["process"].row(), "image_tokens": tokens},
                 {**stages["decode (again)"].row(), "note": note},
                 stages["process (again)"].row()]
    return rows


# -- end to end ----------------------------------------------------------------------------

def end_to_end(pictures: list[Picture], model_path: str, base_url: str,
               requests: int) -> list[dict]:
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
    # Each case's content for request ``run``: a new image each time (a variant of its
    # own), or the same one again (in vLLM's caches after the warm-up round).
    cases: dict[str, Callable[[int], list[dict]]] = {"no image": lambda run: content(None)}
    for p in pictures:
        cases[f"{p.name}, http"] = lambda run, p=p: content(p.url(base_url, 1000 + run))
        cases[f"{p.name}, data:"] = lambda run, p=p: content(p.data_url(2000 + run))
        cases[f"{p.name}, data: again"] = lambda run, p=p: content(p.data_url())
    times: dict[str, list[float]] = {case: [] for case in cases}
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
        for run in range(requests + 1):  # (the first round: a warm-up, not counted)
            for case, make in cases.items():
                parts = make(run)
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
        if "note" in row:
            notes.append(row["note"])
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
        pictures = make_pictures(sizes, directory)
        served = ImageServer(directory)
        load = [round(x, 2) for x in os.getloadavg()]
        try:
            rows = trio.run(frontend, pictures, served.url, args.repeat)
            rows += worker(pictures, model_path, args.repeat)
            show(rows)
            if not args.no_server:
                ends = end_to_end(pictures, model_path, served.url, args.requests)
                show(ends)
                rows += ends
        finally:
            served.close()
    sizes_bytes = {picture.name: len(picture.data()) for picture in pictures}
    print(json.dumps({"images": sizes_bytes, "load_before": load,
                      "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
