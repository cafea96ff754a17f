"""Encoder batching (``engine/groups.py``) on an engine over fake head models:
requests of different models of one stage key run in one batch through the
shared stage, each row through its own model's head, while each request
keeps its tenant's fair share, its deadline, its cancellation and its
model's own counters and costs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from builders import fake_engine, wait_limits
from harness.fake_models import HEAD_POISON
from tessera.admission import TenantLimits
from tessera.engine import Caller, Engine, RequestTrace
from tessera.engine.step import SLOT_WAIT_SHARE
from tessera.errors import InferenceError, ModelUnavailableError
from tessera.tasks.types import ClassifyOutput, Task, TextInput

HEAD: dict[str, Any] = {
    "task": "classify",
    "options": {"stage": "enc", "own_bytes": 100},
    "batching": {"max_batch_size": 16, "max_wait_ms": 50},
}
HEADS = {f"h{i}": HEAD for i in range(4)}
QUIET, FLOOD = Caller(TenantLimits("quiet")), Caller(TenantLimits("flood"))


async def ask(
    engine: Engine, model: str, text: str = "hello", caller: Caller | None = None
) -> tuple[ClassifyOutput, RequestTrace]:
    trace = RequestTrace()
    (output,) = await engine.infer(
        model, Task.CLASSIFY, [TextInput(text)], caller=caller, trace=trace
    )
    assert isinstance(output, ClassifyOutput)
    return output, trace


async def test_one_request_each_to_four_models_runs_as_one_batch_each_row_through_its_head(
    tmp_path: Path,
) -> None:
    async with fake_engine(tmp_path, HEADS) as engine:
        answers = await asyncio.gather(*(ask(engine, m, f"text {m}") for m in HEADS))

        for model, (output, trace) in zip(HEADS, answers, strict=True):
            assert output.labels[0].label == model  # its own head answered it
            assert trace.batch_size == 4  # the batch held every model's request
        stats = engine.snapshot()
        assert (stats.encoder_batches_total, stats.encoder_rows_total) == (1, 4)
        for model in HEADS:
            model_stats = stats.model(model)
            assert model_stats is not None
            assert (model_stats.num_requests, model_stats.num_batches) == (1, 1)


async def test_with_encoder_batching_off_each_model_batches_alone(tmp_path: Path) -> None:
    async with fake_engine(tmp_path, HEADS, encoder_batching=False) as engine:
        answers = await asyncio.gather(*(ask(engine, m) for m in HEADS))

        assert [trace.batch_size for _, trace in answers] == [1, 1, 1, 1]
        assert [output.labels[0].label for output, _ in answers] == list(HEADS)
        assert engine.snapshot().encoder_batches_total == 0


async def test_a_model_alone_in_its_group_batches_on_its_own_queue(tmp_path: Path) -> None:
    models = {"h0": HEAD, "other": {**HEAD, "options": {"stage": "another"}}}
    async with fake_engine(tmp_path, models) as engine:
        answers = await asyncio.gather(ask(engine, "h0"), ask(engine, "other"))

        assert [trace.batch_size for _, trace in answers] == [1, 1]


async def test_a_failing_head_fails_only_its_own_rows(tmp_path: Path) -> None:
    models = {**HEADS, "bad": {**HEAD, "options": {"stage": "enc", "fail_head": True}}}
    async with fake_engine(tmp_path, models) as engine:
        results = await asyncio.gather(
            *(ask(engine, m, HEAD_POISON if m == "bad" else "fine") for m in models),
            return_exceptions=True,
        )

        *good, bad = results
        assert isinstance(bad, InferenceError)
        for model, answer in zip(HEADS, good, strict=True):
            assert not isinstance(answer, BaseException)
            output, trace = answer
            assert output.labels[0].label == model
            assert trace.batch_size == 5
        bad_stats = engine.snapshot().model("bad")
        assert bad_stats is not None
        assert bad_stats.num_failures >= 1


async def test_a_poisoned_input_fails_only_its_own_request(tmp_path: Path) -> None:
    """The shared stage raises for the batch; each model's rows then run on
    their own, where the poisoned request is found and failed alone."""
    options = {"stage": "enc", "fail_on": "poison"}
    models = {m: {**HEAD, "options": options} for m in HEADS}
    async with fake_engine(tmp_path, models) as engine:
        texts = {"h0": "poison", "h1": "fine", "h2": "fine", "h3": "fine"}
        results = await asyncio.gather(
            *(ask(engine, m, t) for m, t in texts.items()), return_exceptions=True
        )

        assert isinstance(results[0], InferenceError)
        for model, answer in zip(list(texts)[1:], results[1:], strict=True):
            assert not isinstance(answer, BaseException)
            assert answer[0].labels[0].label == model


async def test_a_model_that_cannot_load_fails_only_its_own_rows(tmp_path: Path) -> None:
    models = {**HEADS, "broken": {**HEAD, "options": {"stage": "enc", "fail_load": True}}}
    async with fake_engine(tmp_path, models) as engine:
        results = await asyncio.gather(*(ask(engine, m) for m in models), return_exceptions=True)

        *good, broken = results
        assert isinstance(broken, ModelUnavailableError)
        assert all(not isinstance(answer, BaseException) for answer in good)


async def test_a_quiet_tenant_is_served_before_a_flood_across_the_groups_models(
    tmp_path: Path,
) -> None:
    """The group's queue is the fair queue: a flood spread over every model
    does not hold a quiet tenant's request back behind all of it."""
    options = {"stage": "enc", "run_s": 0.05}
    models = {m: {**HEAD, "options": options, "batching": {"max_batch_size": 2}} for m in HEADS}
    async with fake_engine(tmp_path, models) as engine:
        order: list[str] = []

        async def timed(model: str, caller: Caller) -> None:
            await ask(engine, model, caller=caller)
            order.append(caller.tenant)

        flood = [asyncio.ensure_future(timed(m, FLOOD)) for m in list(HEADS) * 4]
        await asyncio.sleep(0.01)  # the flood's first batch runs, the rest waits
        await asyncio.gather(timed("h3", QUIET), *flood)

        assert order.index("quiet") <= 4  # in the second batch, not after 16 flood requests


async def test_a_request_cancelled_while_queued_is_dropped_and_costs_nothing(
    tmp_path: Path,
) -> None:
    options = {"stage": "enc", "run_s": 0.05}
    models = {m: {**HEAD, "options": options, "batching": {"max_batch_size": 1}} for m in HEADS}
    async with fake_engine(tmp_path, models, num_workers=1) as engine:
        first = asyncio.ensure_future(ask(engine, "h0", caller=QUIET))
        await asyncio.sleep(0.01)  # h0's batch holds the slot; the next ones queue
        submission = engine.submit("h1", Task.CLASSIFY, [TextInput("leaving")], caller=QUIET)
        waiting = asyncio.ensure_future(engine.wait(submission))
        last = asyncio.ensure_future(ask(engine, "h2", caller=QUIET))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(first, last)

        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert submission.request.charge.units == 0.0
        h1 = engine.snapshot().model("h1")
        assert h1 is not None
        assert (h1.num_batches, h1.num_dropped) == (0, 1)


async def test_each_tenant_is_charged_its_rows_share_of_the_batch_under_its_model(
    tmp_path: Path,
) -> None:
    async with fake_engine(tmp_path, HEADS) as engine:
        callers = [Caller(TenantLimits(f"t{i}")) for i in range(4)]
        answers = await asyncio.gather(
            *(ask(engine, m, "same text", c) for m, c in zip(HEADS, callers, strict=True))
        )

        charges = [trace.charge for _, trace in answers]
        assert all(c is not None and c.device_s > 0 for c in charges)
        costs = {(c.tenant, c.model): c.device_s for c in engine.snapshot().tenant_costs}
        for model, caller, charge in zip(HEADS, callers, charges, strict=True):
            assert charge is not None
            assert costs[(caller.tenant, model)] == pytest.approx(charge.device_s)
        # Rows of equal units share the batch's run equally.
        shares = [c.device_s for c in charges if c is not None]
        assert max(shares) == pytest.approx(min(shares))


async def test_a_group_batch_waits_for_a_slot_at_most_a_share_of_its_models_tightest_target(
    tmp_path: Path,
) -> None:
    models = {"h0": {**HEAD, "latency_target_ms": 400}, "h1": {**HEAD, "latency_target_ms": 200}}
    async with fake_engine(tmp_path, models) as engine:
        with wait_limits() as seen:
            answers = await asyncio.gather(ask(engine, "h0"), ask(engine, "h1"))
    assert [trace.batch_size for _, trace in answers] == [2, 2]  # one batch of both
    assert seen == [pytest.approx(0.2 * SLOT_WAIT_SHARE)]
