"""A streamed answer's pieces (``pieces_of``): a stream its caller leaves
while it waits for the next piece leaves no task behind (each such leave
logged "Task was destroyed but it is pending" later)."""

from __future__ import annotations

import asyncio
import contextlib

from tessera.gateway.openai_stream import pieces_of


async def test_a_stream_left_while_it_waits_leaves_no_getter_pending() -> None:
    work: asyncio.Future[list[object]] = asyncio.get_running_loop().create_future()
    pieces: asyncio.Queue[str] = asyncio.Queue()
    pieces.put_nowait("a")
    stream = pieces_of(work, pieces)
    assert await anext(stream) == "a"
    waiting = asyncio.ensure_future(anext(stream))  # no piece yet: it waits
    await asyncio.sleep(0)
    waiting.cancel()  # the caller left
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await stream.aclose()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    work.cancel()


async def test_every_piece_comes_before_the_stream_ends() -> None:
    work: asyncio.Future[list[object]] = asyncio.get_running_loop().create_future()
    pieces: asyncio.Queue[str] = asyncio.Queue()

    async def produce() -> None:
        for piece in "abc":
            pieces.put_nowait(piece)
            await asyncio.sleep(0)
        work.set_result([])

    producer = asyncio.ensure_future(produce())
    assert [piece async for piece in pieces_of(work, pieces)] == ["a", "b", "c"]
    await producer
