"""Image requests in a pool of text and vision workers (docs/routing.md): every pick of a
worker for one, a migration's and a resubmission's too, is among the workers whose HELLO
says they take images. In-memory sim workers on virtual time, the first of them text
only (as a remote worker of another configuration would be)."""

from __future__ import annotations

import dataclasses
import hashlib

import server
from server import SamplingParams
from tests.fakes import all_outputs, open_fake_spawner, sim_config

#: Prompt tokens the vision workers count per image.
IMAGE_TOKENS = 7
DATA = b"an image's bytes (the sim checks their digest, and decodes nothing)"
PROMPT = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "describe"},
    {"type": "image", "data": DATA, "sha256": hashlib.sha256(DATA).hexdigest()}]}]}


async def test_a_moved_image_request_goes_to_a_worker_that_takes_images(autojump_clock):
    # Least loaded, ties to the lowest index: worker 1 takes the request first; when it
    # dies, worker 0 (text only, idle) would be next, but only worker 2 takes images.
    config = sim_config(workers=3, routing="least-loaded", image_tokens=IMAGE_TOKENS)
    async with open_fake_spawner() as spawner:

        async def spawn(worker_config):
            if worker_config.worker_index == 0:
                worker_config = dataclasses.replace(worker_config, engine_options={
                    **worker_config.engine_options, "image_tokens": 0})
            return await spawner(worker_config)

        async with server.open_engine(config, spawn=spawn) as engine:
            assert ["images" in w.info for w in engine.workers] == [False, True, True]
            params = SamplingParams(max_tokens=20, temperature=0)
            async with engine.generate(PROMPT, params) as stream:
                choice = stream.choice_states()[0]
                assert choice.worker.index == 1
                pid = choice.worker.pid
                next(p for p in spawner.processes if p.pid == pid).die()
                outs = await all_outputs(stream)
            assert choice.worker.index == 2 and choice.migrations == 1
            assert outs[-1].finish_reason == "length" and outs[-1].error is None
            assert engine.statistics().migration.migrations == {"exited": 1}
            await server.testing.assert_engine_idle(engine)
        spawner.assert_all_exited()


def images_prompt(count: int) -> dict:
    part = PROMPT["messages"][0]["content"][1]
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe"}, *[part] * count]}]}


async def test_a_prompt_goes_to_a_worker_that_takes_as_many_images(autojump_clock):
    # Worker 0 takes no image, worker 1 one a prompt, worker 2 three: the pool takes up to
    # three, and round robin sends a prompt of two images to worker 2 only.
    config = sim_config(workers=3, routing="round-robin", image_tokens=IMAGE_TOKENS)
    limits = {0: 0, 1: 1, 2: 3}
    async with open_fake_spawner() as spawner:

        async def spawn(worker_config):
            index = worker_config.worker_index
            options = {**worker_config.engine_options, "images_per_prompt": limits[index] or 1,
                       "image_tokens": IMAGE_TOKENS if limits[index] else 0}
            return await spawner(dataclasses.replace(worker_config, engine_options=options))

        async with server.open_engine(config, spawn=spawn) as engine:
            assert engine.info["images"]["per_prompt"] == 3
            params = SamplingParams(max_tokens=2, temperature=0)
            served: dict[int, list[int]] = {1: [], 2: []}
            for count in (2, 1, 2, 1, 2, 1, 2, 1):
                async with engine.generate(images_prompt(count), params) as stream:
                    worker = stream.choice_states()[0].worker.index
                    outs = await all_outputs(stream)
                assert outs[-1].error is None, outs[-1].error
                served.setdefault(worker, []).append(count)
            assert 2 not in served[1] and served[2].count(2) == 4 and 0 not in served
            await server.testing.assert_engine_idle(engine)
        spawner.assert_all_exited()
