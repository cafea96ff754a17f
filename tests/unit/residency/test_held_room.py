"""A batch's room kept for its model's next batch (``ResidencyManager.release``
with ``next_batch_s``): while every waiter's patience outlasts that batch, a
model with batches queued does not hand the room it evicted for to a reload
between two batches. Fake models, a fake clock that autojumps.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from builders import make_spec
from harness.fake_host import FakeModelHost
from tessera.clock import FakeClock
from tessera.repository import ModelSpec
from tessera.repository.spec import BatchingSpec
from tessera.residency import ResidencyManager, make_eviction_policy
from tessera.residency.manager import HOLD_SLACK_S, PATIENCE_SHARE

PAGE_BYTES = 600  # an OCR page's activations: beside both models' weights it does not fit


def make_manager() -> tuple[ResidencyManager, FakeModelHost, FakeClock]:
    clock = FakeClock()
    host = FakeModelHost(clock)
    manager = ResidencyManager(1000, host, make_eviction_policy("cost", clock), clock, wait_s=60)
    return manager, host, clock


def models(gather_ms: int = 5) -> tuple[ModelSpec, ModelSpec]:
    """An OCR model (3 s target, ``gather_ms`` gathering wait) and a chat model (10 s target)."""
    ocr = replace(
        make_spec("ocr", 100, batching=BatchingSpec(max_wait_ms=gather_ms)),
        latency_target_ms=3_000,
    )
    chat = replace(make_spec("chat", 400, load_s=0.5), latency_target_ms=10_000)
    return ocr, chat


async def chat_waits_for_a_page(
    gather_ms: int = 5,
) -> tuple[ResidencyManager, FakeModelHost, FakeClock, ModelSpec, asyncio.Future[None]]:
    """The chat model evicted for a page, and a chat request waiting to reload it."""
    manager, host, clock = make_manager()
    ocr, chat = models(gather_ms)
    manager.register([ocr, chat])
    manager.release(await manager.acquire(chat, 0))
    page = await manager.acquire(ocr, PAGE_BYTES)
    assert host.evicted == ["chat"]

    async def answer() -> None:
        manager.release(await manager.acquire(chat, 0))

    waiting = asyncio.ensure_future(answer())
    await clock.sleep(0.01)
    assert not waiting.done()
    manager.release(page, next_batch_s=1.0)  # another page is queued
    return manager, host, clock, ocr, waiting


async def test_a_model_with_batches_queued_keeps_its_room_from_a_waiting_reload() -> None:
    manager, host, clock, ocr, waiting = await chat_waits_for_a_page()
    await clock.sleep(0.001)
    assert not waiting.done()  # the room is the next page's
    asked = clock.now()
    page = await manager.acquire(ocr, PAGE_BYTES)
    assert clock.now() == asked  # taken at once: no eviction, no wait
    assert page.model.memory().own_bytes == 100  # the OCR model, to run the page
    assert host.evicted == ["chat"]
    manager.release(page)  # nothing more queued: the room goes to the reload
    await waiting
    assert host.loads["chat"] == 2


async def test_kept_room_goes_back_when_no_batch_takes_it() -> None:
    _, host, clock, _, waiting = await chat_waits_for_a_page()
    released = clock.now()
    await waiting
    assert host.loads["chat"] == 2
    # The chat model's load takes 0.5 s; the room came back after the page's
    # gathering wait and the slack (to the microsecond: the clock is a fake one).
    assert clock.now() - released == pytest.approx(0.005 + HOLD_SLACK_S + 0.5, abs=1e-6)


async def test_kept_room_waits_for_as_long_as_its_model_gathers_a_batch() -> None:
    _, _, clock, _, waiting = await chat_waits_for_a_page(gather_ms=300)
    released = clock.now()
    await waiting
    assert clock.now() - released == pytest.approx(0.3 + HOLD_SLACK_S + 0.5, abs=1e-6)


async def test_room_is_kept_only_for_batches_that_end_within_every_waiters_patience() -> None:
    manager, host, clock, ocr, waiting = await chat_waits_for_a_page()
    asked = clock.now()
    answered: list[float] = []
    waiting.add_done_callback(lambda _: answered.append(clock.now()))
    patience_s = 10.0 * PATIENCE_SHARE
    kept = 0
    while not waiting.done():
        page = await manager.acquire(ocr, PAGE_BYTES)
        await clock.sleep(1.0)  # each page a second, another always queued
        manager.release(page, next_batch_s=1.0)
        kept += manager.table.activation_bytes_held() == PAGE_BYTES
        await clock.sleep(0.001)
    # The pages kept the room while the next page would end within the chat
    # request's patience (half its 10 s target), then let the chat model reload
    # (0.5 s).
    assert kept == 3  # after the first page's (kept in chat_waits_for_a_page)
    assert patience_s - 1.0 < answered[0] - asked - 0.5 <= patience_s
    assert host.loads["chat"] == 2


@pytest.mark.parametrize(("next_batch_s", "kept"), [(1.0, True), (6.0, False)])
async def test_a_waiting_batchs_patience_bounds_the_room_kept_for_another_model(
    next_batch_s: float, kept: bool
) -> None:
    # Both models stay loaded; a chat batch (5 s of patience: half its 10 s
    # target) waits for activation room held by a page.
    manager, host, clock = make_manager()
    ocr, chat = models()
    manager.register([ocr, chat])
    manager.release(await manager.acquire(chat, 0))
    page = await manager.acquire(ocr, 450)
    waiting = asyncio.ensure_future(manager.acquire(chat, 100))
    await clock.sleep(0.01)
    assert not waiting.done()
    released = clock.now()
    manager.release(page, next_batch_s=next_batch_s)
    manager.release(await waiting)
    waited = 0.005 + HOLD_SLACK_S if kept else 0.0  # the page's gathering wait, and slack
    assert clock.now() - released == pytest.approx(waited, abs=1e-6)
    assert host.evicted == []


async def test_with_no_one_waiting_a_batchs_room_is_not_kept() -> None:
    manager, _, _ = make_manager()
    ocr, chat = models()
    manager.register([ocr, chat])
    manager.release(await manager.acquire(ocr, 0))
    page = await manager.acquire(ocr, 300)
    manager.release(page, next_batch_s=1.0)
    assert manager.table.activation_bytes_held() == 0


async def test_an_unload_gives_back_the_room_kept_for_the_next_batch() -> None:
    manager, host, clock, _, waiting = await chat_waits_for_a_page()
    asked = clock.now()
    assert await manager.unload("ocr")
    assert clock.now() == asked  # at once: not after the kept room's time
    await waiting
    assert host.on_unload == ["chat", "ocr"]
