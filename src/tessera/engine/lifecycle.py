"""The model lifecycle: register models, roll out versions, retire them, while serving.

Design notes (the invariants the tests check):

- A new version loads beside the one it replaces, counted in the budget; the
  old one is kept (never evicted for it, nor for anything) while it serves.
- It takes over only once it has loaded (a first load warms up and measures
  itself) and answered its smoke inputs through the normal request path: the
  checks its card gives (``smoke``: inputs, and texts their answers must
  contain), else its task's sample item (the one its warm-up uses).
- The switch is one assignment between awaits: a request resolved after it
  gets the new version, one queued before stays on the old. The new version's
  batches start only once the old version's requests are answered, so in the
  order the engine answers, the versions switch at one point.
- Then the old version, if its policy no longer serves it, is unloaded and
  forgotten: its bytes go back to the budget.
- A new version that fails to load or answer is rolled back: unloaded and
  forgotten, while the old one never stopped. The failure is in the rollout's
  record (``snapshot().rollouts``, ``/admin/residency``), the log and
  ``rollouts_total``.
- One rollout or retirement per model at a time.

``ModelLifecycle`` is the engine's collaborator for all of this: it owns the
served versions (the engine reads them), and reaches the rest through a few
calls: residency (register, keep, load, retire), the versions' loops (add,
hold, release, remove: ``loops.ModelLoops``) and the request path (a smoke
request is submitted and waited for as any other).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tessera.errors import (
    ModelNotFoundError,
    PermissionDeniedError,
    RolloutFailedError,
    TaskMismatchError,
    TesseraError,
)
from tessera.metrics import RolloutCount, RolloutStats
from tessera.repository import read_versions
from tessera.repository.spec import ModelSpec
from tessera.repository.trust import check_api_card, check_engine_command
from tessera.tasks.samples import answer_text, smoke_item, warmup_items
from tessera.tasks.types import Task

if TYPE_CHECKING:
    from tessera.clock import Clock
    from tessera.repository.watch import RepositoryWatcher
    from tessera.residency import ResidencyManager

    from .host import EngineHost
    from .loops import ModelLoops
    from .types import Caller, RequestTrace, Submission

log = logging.getLogger(__name__)

RECENT_ROLLOUTS = 64


@dataclass
class ServedModel:
    """A model's served versions by key, and the one requests naming no
    version get. Changed only between awaits: a switch is atomic."""

    specs: dict[str, ModelSpec]
    current: str

    @property
    def current_spec(self) -> ModelSpec:
        return self.specs[self.current]


def served_versions(served: Mapping[str, ServedModel], name: str) -> list[ModelSpec]:
    """The versions of model ``name``, oldest first."""
    model = served.get(name)
    if model is None:
        raise ModelNotFoundError(name)
    return sorted(model.specs.values(), key=lambda s: s.version or 0)


def served_spec(served: Mapping[str, ServedModel], name: str) -> ModelSpec:
    """The version ``name`` names: ``model`` (its current version) or
    ``model@version`` (that version, while it is served)."""
    model, _, version = name.partition("@")
    found = served.get(model)
    if found is None:
        raise ModelNotFoundError(model)
    if not version:
        return found.current_spec
    for spec in found.specs.values():
        if spec.version_label == version:
            return spec
    raise ModelNotFoundError(name)


def spec_for_task(spec: ModelSpec, name: str, task: Task) -> ModelSpec:
    """``spec``, if its model does ``task``."""
    if spec.task is not task:
        raise TaskMismatchError(f"model {name!r} does {spec.task.value}, not {task.value}")
    return spec


@dataclass
class _Rollout:
    """A rollout's record as it goes (``RolloutStats`` is its snapshot)."""

    stats: RolloutStats

    def mark(self, **changes: Any) -> None:
        self.stats = dataclasses.replace(self.stats, **changes)


class RequestPath(Protocol):
    """The request path as a smoke check uses it (``intake.RequestIntake``)."""

    def submit(
        self,
        spec: ModelSpec,
        items: Sequence[Any],
        timeout_s: float | None,
        caller: Caller | None,
    ) -> Submission: ...

    async def wait(
        self, submission: Submission, trace: RequestTrace | None = None
    ) -> list[Any]: ...


class ModelLifecycle:
    """The served versions, and the calls that change them while serving."""

    def __init__(
        self,
        served: dict[str, ServedModel],
        *,
        clock: Clock,
        residency: ResidencyManager,
        host: EngineHost,
        loops: ModelLoops,
        requests: RequestPath,
        engine_commands: Mapping[str, tuple[tuple[str, ...], ...]],
        drain_wait_s: float,
    ) -> None:
        """``served``: the versions served at start (registered already);
        ``drain_wait_s``: the longest a switch waits for the replaced
        version's requests."""
        self._served = served
        self.clock = clock
        self._residency = residency
        self._host = host
        self._loops = loops
        self._requests = requests
        # The command lines a card may name per engine (``repository/trust.py``).
        self._engine_commands = engine_commands
        self._drain_wait_s = drain_wait_s
        self._rollouts: deque[_Rollout] = deque(maxlen=RECENT_ROLLOUTS)
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self._staged: dict[str, ModelSpec] = {}  # versions loading or checking
        self._model_locks: dict[str, asyncio.Lock] = {}

    # -- the face ---------------------------------------------------------

    @property
    def served(self) -> Mapping[str, ServedModel]:
        """Each model's served versions (read only: changed here, between awaits)."""
        return self._served

    async def add_model(self, folder: Path, via_api: bool = False) -> list[RolloutStats]:
        """Register the model in ``folder`` (validated: descriptor, weights,
        a load and an answer), or roll out its versions that are new and retire
        those its policy no longer serves. Raises ``ConfigError`` for a bad
        descriptor, ``RolloutFailedError`` for a version rolled back, and
        ``PermissionDeniedError`` for what a card registered over the API
        (``via_api``) may not do (``repository/trust.py``)."""
        versions = self._checked_versions(folder, via_api)
        name = versions[0].name
        async with self._model_lock(name):
            served = self._served.get(name)
            known = set(served.specs) if served is not None else set()
            wanted = {spec.key for spec in versions}
            done = []
            for spec in versions:
                if spec.key not in known or served is None:
                    done.append(await self._roll_out(spec, retire=known - wanted))
                    served = self._served[name]
                    known = set(served.specs)
            for key in sorted(known - wanted):
                await self._retire_version(self._served[name], key)
            return done

    async def remove_model(self, name: str) -> int:
        """Retire model ``name``: new requests get 404 at once, those in flight
        are answered, every version is unloaded and forgotten. Returns the
        bytes of the budget freed."""
        async with self._model_lock(name):
            served = self._served.pop(name, None)
            if served is None:
                raise ModelNotFoundError(name)
            before = self._residency.table.weight_bytes()
            for key in list(served.specs):
                await self._retire_version(served, key)
            freed = before - self._residency.table.weight_bytes()
            log.info("model %s retired, %d bytes freed", name, freed)
            return freed

    async def watch_repository(self, watcher: RepositoryWatcher, interval_s: float) -> None:
        """Until cancelled: every ``interval_s``, hand each model folder the
        watcher says changed to ``add_model`` (a failure is logged: a version
        that fails is rolled back and the old one serves on)."""
        while True:
            await self.clock.sleep(interval_s)
            for folder in await asyncio.to_thread(watcher.poll):
                try:
                    rollouts = await self.add_model(folder)
                except (TesseraError, OSError) as e:
                    log.warning("repository watch: %s not served: %s", folder.name, e)
                    continue
                for r in rollouts:
                    log.info("repository watch: %s@%s %s", r.model, r.version, r.state)

    def _checked_versions(self, folder: Path, via_api: bool) -> list[ModelSpec]:
        """``folder``'s versions, once the server's rules allow each card."""
        versions = read_versions(folder)
        for spec in versions:
            if via_api:  # first: the API's refusal names the key whatever its value
                check_api_card(spec)
            check_engine_command(spec, self._engine_commands)
        if not via_api:
            return versions
        return [dataclasses.replace(spec, via_api=True) for spec in versions]

    def recent_rollouts(self) -> tuple[RolloutStats, ...]:
        return tuple(r.stats for r in self._rollouts)

    def rollout_counts(self) -> tuple[RolloutCount, ...]:
        return tuple(RolloutCount(m, o, n) for (m, o), n in sorted(self._outcomes.items()))

    def staged_versions(self) -> dict[str, ModelSpec]:
        """Versions loading or being checked, not serving yet."""
        return dict(self._staged)

    # -- one rollout --------------------------------------------------------

    def _model_lock(self, name: str) -> asyncio.Lock:
        return self._model_locks.setdefault(name, asyncio.Lock())

    async def _roll_out(self, spec: ModelSpec, retire: Iterable[str]) -> RolloutStats:
        served = self._served.get(spec.name)
        old = served.current_spec if served is not None else None
        used = self._residency.table.weight_bytes()
        record = _Rollout(
            RolloutStats(
                model=spec.name,
                version=spec.version_label,
                replaces=old.version_label if old is not None else None,
                state="loading",
                error=None,
                started_at=self.clock.now(),
                loaded_at=None,
                checked_at=None,
                switched_at=None,
                drained_at=None,
                finished_at=None,
                used_bytes_before=used,
                used_bytes_peak=used,
                used_bytes_after=None,
            )
        )
        self._rollouts.append(record)
        if old is not None:
            self._residency.keep(old.key)
        try:
            await self._stage(spec, record)
            self._switch(spec, record, retire)
            await self._drain(old, spec, record)
            for key in retire:
                await self._retire_version(self._served[spec.name], key)
        finally:
            if old is not None:
                self._residency.keep(old.key, kept=False)
        record.mark(
            state="done",
            finished_at=self.clock.now(),
            used_bytes_after=self._residency.table.weight_bytes(),
        )
        self._outcomes[(spec.name, "done")] += 1
        log.info("model %s now serves version %s", spec.name, spec.version_label)
        return record.stats

    async def _stage(self, spec: ModelSpec, record: _Rollout) -> None:
        """Load ``spec`` beside the serving versions and check it answers;
        on failure roll it back and raise ``RolloutFailedError``."""
        self._staged[spec.key] = spec
        self._residency.register([spec])
        self._loops.add(spec)
        try:
            await self._residency.ensure_loaded(spec)
            record.mark(
                state="checking",
                loaded_at=self.clock.now(),
                used_bytes_peak=self._residency.table.weight_bytes(),
            )
            await self._smoke(spec)
            record.mark(checked_at=self.clock.now())
        except Exception as e:
            # Residency holds a failed load's own cause (callers are told less).
            cause = self._residency.error(spec.key) or f"{type(e).__name__}: {e}"
            refused = e.__cause__ if isinstance(e.__cause__, PermissionDeniedError) else None
            log.error(
                "version %s of model %s rolled back: %s", spec.version_label, spec.name, cause
            )
            record.mark(state="rolled_back", error=cause, finished_at=self.clock.now())
            self._outcomes[(spec.name, "rolled_back")] += 1
            await self._forget_version(spec.key)
            record.mark(used_bytes_after=self._residency.table.weight_bytes())
            if refused is not None:  # the server's rules, not a broken version: 403
                raise PermissionDeniedError(str(refused)) from e
            raise RolloutFailedError(spec.name, spec.version_label, cause) from e
        finally:
            self._staged.pop(spec.key, None)

    async def _smoke(self, spec: ModelSpec) -> None:
        """Run the card's smoke checks (else the task's sample item) on ``spec``
        through the request path: each must be answered, and contain its
        ``expect`` where the card gives one."""
        checks = spec.smoke
        if checks:
            items = [smoke_item(spec.task, c.input, spec.folder) for c in checks]
        else:
            items = warmup_items(spec.task, 1)
        submission = self._requests.submit(spec, items, None, None)
        outputs = await self._requests.wait(submission)
        if len(outputs) != len(items) or not all(_answers(o) for o in outputs):
            raise ValueError(f"no valid answer to its smoke input: {outputs!r:.200}")
        for check, output in zip(checks, outputs, strict=False):  # none: the sample item
            text = answer_text(output)
            if check.expect is not None and (text is None or check.expect not in text):
                raise ValueError(
                    f"smoke input {check.input!r:.80} answered {text!r:.200},"
                    f" not containing {check.expect!r}"
                )

    def _switch(self, spec: ModelSpec, record: _Rollout, retire: Iterable[str]) -> None:
        """New requests go to ``spec`` from now on (one step, no await); its
        batches wait until the versions it replaces have answered theirs."""
        served = self._served.get(spec.name)
        if served is None:
            self._served[spec.name] = ServedModel({spec.key: spec}, spec.key)
        else:
            old_key = served.current
            served.specs[spec.key] = spec
            served.current = spec.key
            for key in retire:
                served.specs.pop(key, None)
            if self._loops.pending(old_key):
                self._loops.hold(spec.key)
        record.mark(state="draining", switched_at=self.clock.now())

    async def _drain(self, old: ModelSpec | None, spec: ModelSpec, record: _Rollout) -> None:
        """Wait (bounded) for the replaced version's requests, then let the new
        version's batches start."""
        try:
            if old is not None:
                await self._answered(old.key)
        finally:
            self._loops.release(spec.key)
        record.mark(drained_at=self.clock.now())

    async def _answered(self, key: str) -> None:
        """Until the requests queued on ``key`` are answered (they have deadlines;
        bounded by the drain wait all the same)."""
        futures = self._loops.pending(key)
        if futures:
            with contextlib.suppress(TimeoutError):
                await self.clock.wait_for(asyncio.wait(futures), self._drain_wait_s)

    async def _retire_version(self, served: ServedModel, key: str) -> None:
        """Stop serving version ``key``, answer its requests, then unload and forget it."""
        served.specs.pop(key, None)
        await self._answered(key)
        await self._forget_version(key)

    async def _forget_version(self, key: str) -> None:
        """Close version ``key``'s loop, retire it from residency, then forget it
        (its loop and counters stay readable until then: it may still be staged)."""
        loop = self._loops.get(key)
        if loop is not None:
            await loop.close()
        await self._residency.retire(key)
        self._host.forget(key)
        self._loops.remove(key)


def _answers(output: object) -> bool:
    """Whether a smoke output is an answer: present, and finite if numeric."""
    if output is None:
        return False
    if isinstance(output, np.ndarray | float):
        return bool(np.all(np.isfinite(output)))
    return True
