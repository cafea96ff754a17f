"""Encoder batching's policy (``engine/groups.py``, ``engine/loops.py``):
which requests share a batch, the limits of a batch of several models' rows,
and how a batch's outputs come back when one head fails."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from builders import make_spec
from tessera.clock import FakeClock
from tessera.engine import EngineConfig
from tessera.engine.groups import HeadFailed, by_model, merged_batching, run_heads
from tessera.engine.loops import ModelLoops
from tessera.engine.step import StepPolicies
from tessera.errors import InferenceError, ModelOutputError, OverloadedError
from tessera.repository.spec import BatchingSpec
from tessera.request import QueuedRequest

# --- the limits of a batch of several models -----------------------------------


def test_a_batch_of_several_models_keeps_within_every_cards_limits() -> None:
    merged = merged_batching(
        [
            BatchingSpec(max_batch_size=32, max_batch_units=8192, max_wait_ms=5),
            BatchingSpec(max_batch_size=16, max_batch_units=9000, max_wait_ms=20),
            BatchingSpec(max_batch_size=64, max_batch_units=4096, max_wait_ms=2),
        ]
    )

    assert (merged.max_batch_size, merged.max_batch_units, merged.max_wait_ms) == (16, 4096, 2)
    assert merged.max_concurrent_batches is None


def test_the_fewest_batches_at_once_a_card_fixes_bounds_the_group() -> None:
    merged = merged_batching(
        [BatchingSpec(max_concurrent_batches=None), BatchingSpec(max_concurrent_batches=2)]
    )

    assert merged.max_concurrent_batches == 2


# --- which rows go together -----------------------------------------------------


def queued(model: str, tenant: str = "t") -> QueuedRequest:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return QueuedRequest([model], 1.0, 0.0, future, tenant=tenant, model=model)


async def test_a_batch_s_rows_go_by_model_in_the_order_of_each_model_s_first_request() -> None:
    a1, b1, a2, c1, b2 = queued("a"), queued("b"), queued("a"), queued("c"), queued("b")

    grouped = by_model([a1, b1, a2, c1, b2])

    assert list(grouped) == ["a", "b", "c"]
    assert grouped == {"a": [a1, a2], "b": [b1, b2], "c": [c1]}


# --- a run of several heads -------------------------------------------------------


class Head:
    """An ``EncoderHead`` whose first stage is an item's index as a row, and
    whose head answers a row with (its name, the row's value), or fails as told."""

    stage_key = "stage"

    def __init__(self, name: str, answer: str = "ok") -> None:
        self.name = name
        self.answer = answer
        self.rows: list[list[float]] = []

    def vectors(self, items: Sequence[Any]) -> np.ndarray[Any, Any]:
        return np.array([[float(i)] for i in range(len(items))], dtype=np.float32)

    def head(self, vectors: np.ndarray[Any, Any]) -> list[Any]:
        self.rows.append([float(v[0]) for v in vectors])
        if self.answer == "raise":
            raise RuntimeError("broken head")
        if self.answer == "short":
            return [(self.name, float(v[0])) for v in vectors][:-1]
        if self.answer == "nan":
            return [math.nan for _ in vectors]
        return [(self.name, float(v[0])) for v in vectors]


def test_each_head_gets_its_own_rows_of_the_shared_stage_in_order() -> None:
    a, b = Head("a"), Head("b")

    outputs = run_heads(a, [("a", a, 2), ("b", b, 3)], ["x"] * 5)

    assert outputs == [("a", 0.0), ("a", 1.0), ("b", 2.0), ("b", 3.0), ("b", 4.0)]
    assert (a.rows, b.rows) == ([[0.0, 1.0]], [[2.0, 3.0, 4.0]])


@pytest.mark.parametrize(
    ("answer", "error"),
    [("raise", RuntimeError), ("short", InferenceError), ("nan", ModelOutputError)],
)
def test_a_failing_head_marks_only_its_own_rows(answer: str, error: type[Exception]) -> None:
    a, bad, c = Head("a"), Head("bad", answer), Head("c")

    outputs = run_heads(a, [("a", a, 1), ("bad", bad, 2), ("c", c, 1)], ["x"] * 4)

    assert outputs[0] == ("a", 0.0)
    assert outputs[3] == ("c", 3.0)
    assert all(isinstance(o, HeadFailed) and isinstance(o.error, error) for o in outputs[1:3])


def test_a_failing_first_stage_fails_the_whole_run() -> None:
    class Broken(Head):
        def vectors(self, items: Sequence[Any]) -> np.ndarray[Any, Any]:
            raise RuntimeError("poisoned input")

    broken = Broken("a")

    with pytest.raises(RuntimeError, match="poisoned"):
        run_heads(broken, [("a", broken, 1)], ["x"])


# --- where a request queues ----------------------------------------------------------


def loops(encoder_batching: bool = True) -> ModelLoops:
    """Loops over policies that forming and routing batches read (the clock,
    the workers' count, the device's kind); staged by their option ``stage``."""
    policies = StepPolicies(
        residency=None,  # type: ignore[arg-type]  # routing never reaches residency
        executor=SimpleNamespace(num_workers=2),  # type: ignore[arg-type]
        stats=None,  # type: ignore[arg-type]
        clock=FakeClock(),
        device_kind="cpu",
        costs=None,  # type: ignore[arg-type]
    )
    config = EngineConfig(encoder_batching=encoder_batching)
    return ModelLoops(config, policies, lambda spec: spec.options.get("stage"))


async def test_requests_queue_on_the_group_once_it_has_two_members() -> None:
    models = loops()
    first = models.add(make_spec("a", stage="enc"))
    (group,) = models.groups()

    models.submit(first, queued("a"))  # alone in its group: its own queue
    assert (first.batcher.depth, group.batcher.depth) == (1, 0)

    second = models.add(make_spec("b", stage="enc"))
    models.submit(first, queued("a"))
    models.submit(second, queued("b"))
    assert (first.batcher.depth, second.batcher.depth, group.batcher.depth) == (1, 0, 2)
    assert second.predictor is first.predictor is group.predictor
    assert models.queue_depths() == {"a": (2, 0), "b": (1, 0)}
    await models.close()


async def test_models_of_another_stage_or_none_queue_alone() -> None:
    models = loops()
    a = models.add(make_spec("a", stage="enc"))
    b = models.add(make_spec("b", stage="enc"))
    other = models.add(make_spec("other", stage="another"))
    plain = models.add(make_spec("plain"))

    for loop in (a, b, other, plain):
        models.submit(loop, queued(loop.spec.key))

    assert [g.key for g in models.groups()] == ["enc", "another"]
    assert (other.batcher.depth, plain.batcher.depth) == (1, 1)
    assert (a.batcher.depth, b.batcher.depth) == (0, 0)
    await models.close()


async def test_a_version_held_behind_its_predecessor_queues_on_its_own() -> None:
    models = loops()
    a = models.add(make_spec("a", stage="enc"))
    models.add(make_spec("b", stage="enc"))
    models.hold("a")

    models.submit(a, queued("a"))
    assert a.batcher.depth == 1  # its gate holds its batches; the group's would not wait

    models.release("a")
    models.submit(a, queued("a"))
    assert a.batcher.depth == 1
    await models.close()


async def test_with_encoder_batching_off_no_group_is_made() -> None:
    models = loops(encoder_batching=False)
    a = models.add(make_spec("a", stage="enc"))
    models.add(make_spec("b", stage="enc"))

    models.submit(a, queued("a"))

    assert models.groups() == []
    assert a.batcher.depth == 1
    await models.close()


async def test_a_group_bounds_each_member_s_requests_as_its_own_queue_would() -> None:
    models = loops()
    a = models.add(make_spec("a", stage="enc"))
    models.add(make_spec("b", stage="enc"))
    (group,) = models.groups()
    group.max_queue = 2

    for _ in range(2):
        request = queued("a")
        models.submit(a, request)
        a.pending.add(request)  # as the intake adds what it queued

    with pytest.raises(OverloadedError, match="queue of model 'a' is full"):
        models.submit(a, queued("a"))
    await models.close()


async def test_a_member_that_leaves_takes_the_group_back_to_one() -> None:
    models = loops()
    a = models.add(make_spec("a", stage="enc"))
    models.add(make_spec("b", stage="enc"))

    models.remove("b")
    models.submit(a, queued("a"))

    assert a.batcher.depth == 1
    await models.close()
