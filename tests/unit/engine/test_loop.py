"""The engine process's event loop: a selector that polls with a timeout of
zero at most every so often, and the loop settings that name it."""

from __future__ import annotations

import asyncio
import selectors
import socket
from collections.abc import Iterator

import pytest
import uvicorn

from tessera.config import build_config
from tessera.engine.loop import (
    DEFAULT_ENGINE_LOOP,
    PatientSelector,
    loop_factory,
    patient_loop,
    uvicorn_loop,
)
from tessera.errors import ConfigError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def readable(pair: tuple[socket.socket, socket.socket], every_s: float) -> PatientSelector:
    """A selector polling at most every ``every_s``, over a socket with a byte to read."""
    reader, writer = pair
    selector = PatientSelector(every_s=every_s)
    selector.register(reader, selectors.EVENT_READ)
    writer.send(b"x")
    return selector


def test_a_poll_stands_while_callbacks_are_ready(pair: tuple[socket.socket, socket.socket]) -> None:
    selector = readable(pair, 3600.0)

    assert len(selector.select(0)) == 1  # the first poll
    assert selector.select(0) == []  # the byte is there, but the last poll's answer stands
    assert selector.select(-1) == []
    assert (selector.polls, selector.skipped) == (1, 2)
    assert len(selector.select(0.5)) == 1  # a poll that may wait always polls
    assert selector.polls == 2
    selector.close()


def test_a_poll_stands_no_longer_than_its_time(pair: tuple[socket.socket, socket.socket]) -> None:
    selector = readable(pair, 0.0)

    assert [len(selector.select(0)) for _ in range(3)] == [1, 1, 1]
    assert (selector.polls, selector.skipped) == (3, 0)
    selector.close()


def test_the_patient_loop_runs_ready_callbacks_without_a_poll_each_and_reads_its_sockets(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    reader, writer = pair
    loop = patient_loop()
    selector = loop._selector  # type: ignore[attr-defined]
    assert isinstance(selector, PatientSelector)
    turns = 0
    got = loop.create_future()

    def spin() -> None:  # a loop always busy: a callback ready at every turn
        nonlocal turns
        turns += 1
        if not got.done() and turns < 10_000_000:
            loop.call_soon(spin)

    def readable() -> None:
        if not got.done():
            got.set_result(reader.recv(16))

    loop.add_reader(reader, readable)
    writer.send(b"hello")
    loop.call_soon(spin)
    try:
        assert loop.run_until_complete(got) == b"hello"  # read though the loop never idled
    finally:
        loop.remove_reader(reader)
        loop.close()
    assert selector.skipped > 0
    assert selector.polls < turns


def test_loop_names() -> None:
    assert DEFAULT_ENGINE_LOOP == "patient"
    assert loop_factory("asyncio") is asyncio.SelectorEventLoop
    with pytest.raises(ValueError, match="engine_loop"):
        loop_factory("trio")
    assert uvicorn_loop("asyncio") == "asyncio"
    assert uvicorn_loop("uvloop") == "uvloop"
    # uvicorn makes the patient loop from its setting (the engine process's server).
    factory = uvicorn.Config(app=None, loop=uvicorn_loop("patient")).get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop._selector, PatientSelector)  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_the_config_names_the_engine_loop() -> None:
    assert build_config({}, {}).engine_loop == "patient"
    assert build_config({"engine_loop": "uvloop"}, {}).engine_loop == "uvloop"
    with pytest.raises(ConfigError, match="engine_loop must be one of patient, asyncio, uvloop"):
        build_config({"engine_loop": "fast"}, {})
