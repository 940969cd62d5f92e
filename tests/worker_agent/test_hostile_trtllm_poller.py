"""TensorRT-LLM's pull path against a hostile engine, over a real HTTP server: response bodies over the
byte limit (announced, chunked, or compressed), bodies that used to stop the poll loop, and the loop
surviving a poll that fails in a way nobody planned for. A dropped body is a lost batch: the next
event_id shows the gap and the rank is reset."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.worker_agent.events import BlockRemoved, DecodedBatch
from kvroute.worker_agent.trtllm_events import TrtllmEventConverter
from kvroute.worker_agent.trtllm_poller import TrtllmEventPoller

WINDOW = 64


def removed(event_id: int) -> dict:
    return {"event_id": event_id, "data": {"type": "removed", "block_hashes": [event_id]}, "window_size": WINDOW}


class Engine:
    """A trtllm-serve stand-in whose POST /kv_cache_events answers the queued responses in turn (then [])."""

    def __init__(self) -> None:
        self.responses: list[web.StreamResponse | web.Response] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not self.responses:
            return web.json_response([])
        answer = self.responses.pop(0)
        if callable(answer):
            return await answer(request)
        return answer

    async def start(self) -> TestServer:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self.handle)
        server = TestServer(app)
        await server.start_server()
        return server


class Recorder:
    def __init__(self, url: str, max_body_bytes: int) -> None:
        self.batches: list[DecodedBatch] = []
        self.resets: list[str] = []
        self.poller = TrtllmEventPoller(
            url,
            TrtllmEventConverter(),
            lambda rank, b: self.batches.append(b),
            lambda rank, why: self.resets.append(why),
            interval_s=0.01,
            timeout_s=2,
            max_body_bytes=max_body_bytes,
        )

    def removed_ids(self) -> list[int]:
        return [h for b in self.batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def chunked(body: bytes):
    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(body), 100):
            await resp.write(body[i : i + 100])
        await resp.write_eof()
        return resp

    return answer


def gzipped(body: bytes) -> web.Response:
    return web.Response(body=gzip.compress(body), headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})


BIG = json.dumps([removed(i) for i in range(1, 200)]).encode()  # ~15 KB, over the 4 KiB limit below


@pytest.mark.parametrize(
    "answer",
    [web.Response(body=BIG, content_type="application/json"), chunked(BIG), gzipped(BIG)],
    ids=["content-length", "chunked", "gzip"],
)
async def test_a_body_over_the_limit_is_dropped_and_counted_and_the_gap_resets_the_rank(answer) -> None:
    engine = Engine()
    server = await engine.start()
    engine.responses = [web.json_response([removed(0)]), answer, web.json_response([removed(200)])]
    rec = Recorder(str(server.make_url("/")), max_body_bytes=4096)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for _ in range(3):
                assert await rec.poller.poll_once(session)
        c = rec.poller.converter.counters
        assert c.oversize_bodies == 1 and c.malformed_frames == 0
        assert rec.removed_ids() == [0, 200] and len(rec.resets) == 1 and "gap" in rec.resets[0]
    finally:
        await server.close()


async def test_a_body_under_the_limit_is_read_whole_however_it_is_sent() -> None:
    engine = Engine()
    server = await engine.start()
    body = json.dumps([removed(i) for i in range(30)]).encode()
    engine.responses = [chunked(body), gzipped(json.dumps([removed(30)]).encode())]
    rec = Recorder(str(server.make_url("/")), max_body_bytes=len(body))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            assert await rec.poller.poll_once(session) and await rec.poller.poll_once(session)
        assert rec.removed_ids() == list(range(31)) and rec.resets == []
        assert rec.poller.converter.counters.oversize_bodies == 0
    finally:
        await server.close()


async def test_regression_a_number_past_every_range_no_longer_stops_the_poll_loop() -> None:
    """An event whose hash had more digits than msgspec reads raised ValidationError out of `feed`, out of
    `poll_once` and out of `run`: the agent's task group failed and the agent exited."""
    engine = Engine()
    server = await engine.start()
    hostile = b'[{"event_id": 0, "data": {"type": "removed", "block_hashes": [1' + b"0" * 5000 + b"]}}]"
    engine.responses = [web.Response(body=hostile, content_type="application/json"), web.json_response([removed(1)])]
    rec = Recorder(str(server.make_url("/")), max_body_bytes=1 << 20)
    task = asyncio.create_task(rec.poller.run())
    try:
        for _ in range(200):
            if rec.removed_ids() or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), task.exception()
        assert rec.removed_ids() == [1] and rec.poller.converter.counters.malformed_events == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.close()


class BrokenConverter(TrtllmEventConverter):
    """A converter with a bug that shows on its first body only."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies = 0

    def feed(self, body: bytes):
        self.bodies += 1
        if self.bodies == 1:
            raise RuntimeError("a bug")
        return super().feed(body)


async def test_a_poll_that_fails_unexpectedly_is_counted_and_the_loop_goes_on() -> None:
    engine = Engine()
    server = await engine.start()
    engine.responses = [web.json_response([removed(0)]), web.json_response([removed(1)])]
    batches: list[DecodedBatch] = []
    poller = TrtllmEventPoller(
        str(server.make_url("/")),
        BrokenConverter(),
        lambda r, b: batches.append(b),
        lambda r, why: None,
        interval_s=0.01,
        timeout_s=2,
    )
    task = asyncio.create_task(poller.run())
    try:
        for _ in range(200):
            if batches or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done() and poller.counters.callback_errors == 1
        assert [e.block_hashes for b in batches for e in b.events] == [[1]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.close()
