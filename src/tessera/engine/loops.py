"""The served versions' loops (``step.ModelLoop``) and their encoder groups
(``groups.EncoderGroup``), by key: where a request queues.

A version's requests queue on its own loop's batcher, or on its encoder
group's where the group takes them (``EncoderGroup.takes``: two members or
more, the version not held behind the one it replaces). A version joins a
group when it is added, by the stage key its loader says
(``host.stage_key``); with ``encoder_batching`` off no version does.
The members of a group share its run-time predictor: a member's own batches
and the group's run the same encoder.

(Not to be confused with ``loop.py``: the engine process's event loop.)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from tessera.batching import ModelBatcher, make_queue
from tessera.repository.spec import ModelSpec
from tessera.request import QueuedRequest
from tessera.scheduling import BatchTimePredictor

from .groups import EncoderGroup
from .step import ModelLoop, StepPolicies
from .types import EngineConfig

# A version's stage key, or None (``host.stage_key``).
StageOf = Callable[[ModelSpec], str | None]


def _no_stage(spec: ModelSpec) -> str | None:
    return None


class ModelLoops:
    """The served versions' loops, by key: the engine's, and the lifecycle's
    to add, hold and retire; and the encoder groups they belong to."""

    def __init__(
        self, config: EngineConfig, policies: StepPolicies, stage_of: StageOf = _no_stage
    ) -> None:
        self._config = config
        self._policies = policies
        self._stage_of = stage_of if config.encoder_batching else _no_stage
        self._loops: dict[str, ModelLoop] = {}
        self._groups: dict[str, EncoderGroup] = {}  # by stage key
        self._group_of: dict[str, EncoderGroup] = {}  # by version key

    def add(self, spec: ModelSpec) -> ModelLoop:
        """A loop for version ``spec``, its queue as the config says; a member
        of its encoder group where it has one."""
        group = self._group(spec)
        predictor = group.predictor if group is not None else BatchTimePredictor()
        batcher = self._batcher(spec.key, spec, predictor)
        loop = self._loops[spec.key] = ModelLoop(spec, batcher, predictor, self._policies)
        if group is not None:
            group.join(loop)
            self._group_of[spec.key] = group
        return loop

    def _group(self, spec: ModelSpec) -> EncoderGroup | None:
        """``spec``'s encoder group, made where it is the first of its stage."""
        stage = self._stage_of(spec)
        if stage is None:
            return None
        group = self._groups.get(stage)
        if group is None:
            predictor = BatchTimePredictor()
            name = f"encoder group of {spec.name}"
            batcher = self._batcher(name, spec, predictor)
            group = EncoderGroup(stage, batcher, predictor, self._policies, self._config.max_queue)
            self._groups[stage] = group
        return group

    def _batcher(self, name: str, spec: ModelSpec, predictor: BatchTimePredictor) -> ModelBatcher:
        config, policies = self._config, self._policies
        return ModelBatcher(
            name,
            spec.batching,
            policies.clock,
            max_queue=config.max_queue,
            queue=make_queue(config.scheduling, predictor, config.fair_quantum_s),
            max_concurrent_batches=policies.executor.num_workers,
            predictor=predictor,
            # A partial batch waits for company on the CPU only (batcher.py).
            gather_idle=policies.device_kind != "cuda",
            step_past=_steps_past(config, spec),
        )

    def submit(self, loop: ModelLoop, request: QueuedRequest, *, counted: bool = True) -> None:
        """Queue ``request`` of ``loop``'s version where it queues now (module
        notes), and start the loop that serves that queue."""
        group = self._group_of.get(loop.spec.key)
        if group is not None and group.takes(loop):
            group.submit(loop, request, counted=counted)
            return
        loop.batcher.submit(request, counted=counted)
        loop.start()

    def __getitem__(self, key: str) -> ModelLoop:
        return self._loops[key]

    def get(self, key: str) -> ModelLoop | None:
        return self._loops.get(key)

    def __iter__(self) -> Iterator[ModelLoop]:
        return iter(list(self._loops.values()))

    def groups(self) -> list[EncoderGroup]:
        return list(self._groups.values())

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """Each version's requests waiting and dropped (their deadline passed,
        or their caller left) so far, on its own queue and its group's."""
        waiting: Counter[str] = Counter()
        for group in self._groups.values():
            waiting.update(group.batcher.depth_by_model())
        out = {}
        for key, loop in self._loops.items():
            member_of = self._group_of.get(key)
            dropped = member_of.batcher.dropped_by_model[key] if member_of is not None else 0
            out[key] = (loop.batcher.depth + waiting[key], loop.batcher.num_dropped + dropped)
        return out

    def pending(self, key: str) -> list[asyncio.Future[Any]]:
        """The futures of the requests queued on version ``key``, not answered yet."""
        loop = self._loops.get(key)
        return [r.future for r in loop.pending] if loop is not None else []

    def hold(self, key: str) -> None:
        """Version ``key`` starts no batch until ``release`` (its requests
        queue on its own loop meanwhile, not its group's)."""
        self._loops[key].gate = asyncio.Event()

    def release(self, key: str) -> None:
        loop = self._loops.get(key)
        if loop is not None and loop.gate is not None:
            loop.gate.set()
            loop.gate = None

    def remove(self, key: str) -> None:
        """Forget version ``key``'s loop (closed already: ``ModelLoop.close``)
        and take it out of its group."""
        self._loops.pop(key, None)
        group = self._group_of.pop(key, None)
        if group is not None:
            group.leave(key)

    async def close(self) -> None:
        """Open every gate, then close every loop and every group."""
        for loop in self._loops.values():
            if loop.gate is not None:
                loop.gate.set()
        for loop in list(self._loops.values()):
            await loop.close()
        for group in list(self._groups.values()):
            await group.close()


def _steps_past(config: EngineConfig, spec: ModelSpec) -> bool:
    """Whether a tenant with nothing running on ``spec``'s model may start
    a batch beyond its busy slots (``ModelBatcher.step_past``): with fair
    parts and fair scheduling, unless the card fixes the batches at once
    for an in-process runtime (an external engine's window has room)."""
    fair = config.fair_parts and config.scheduling == "fair"
    fixed = spec.batching.max_concurrent_batches is not None
    return fair and (not fixed or spec.runtime == "external")
