"""A worker that serves from its first lanes while the others capture (``cadence_fx.serve.warming``),
as the controller sees it, with fake workers in this process: it joins at the capacity of the lanes
online, admission waits or refuses past it, and once ``wait_lanes`` answers the controller admits the
worker's full capacity and wakes the admissions waiting for room. A capture that fails leaves the
worker serving at the capacity it joined with; a worker that died meanwhile is left as it is. No
timings: the fake's ``wait_lanes`` returns when the test releases it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("ray")

from cadence_fx.serve import controller as controller_mod  # noqa: E402
from cadence_fx.serve.calibration import given_capacity  # noqa: E402
from cadence_fx.serve.checkpoints import CheckpointPolicy  # noqa: E402
from cadence_fx.serve.controller import ControllerConfig, ServeController  # noqa: E402
from cadence_fx.serve.conversation import AdmissionRefused, StepResult  # noqa: E402
from cadence_fx.serve.worker import WorkerConfig, WorkerStatus  # noqa: E402

LANES = 4
WAIT_S = 30.0  # generous: every wait below ends on an event, never on this


def status(name: str, online: int) -> Any:
    """The worker's status with ``online`` of its 4 lanes captured: capacity 1 per lane online."""
    base = WorkerStatus(name=name, pid=0, node_id=None, device="cpu", lanes=LANES, capacity=online,
                        calibration=given_capacity(LANES, 1.0), conversations=(), load=0.0, lanes_busy=0,
                        ready_s=0.5, load_s=0.1, warmup_s=0.4, calibrate_s=0.0, chunks=0, chunk_p50_ms=0.0,
                        chunk_p99_ms=0.0)
    extra = {"lanes_online": online, "capacity_full": LANES,
             "lanes_ready_s": 2.0 if online == LANES else None, "warmup_error": None}
    if "lanes_online" in WorkerStatus.__dataclass_fields__:
        return dataclasses.replace(base, **extra)
    return SimpleNamespace(**vars(base), **extra)  # until the worker's status has the fields


class Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)  # a coroutine: awaited as Ray's ObjectRef is


async def _value(x: Any) -> Any:
    return x


class FakeWorker:
    """A worker actor's handle: ``status`` says 1 lane of 4 online until ``wait_lanes`` is released
    (then 4, or the capture's error)."""

    def __init__(self, name: str, error: Exception | None = None) -> None:
        self.name, self.error, self.online, self.waits = name, error, 1, 0
        self.released = asyncio.Event()
        self.waited = asyncio.Event()  # wait_lanes was called
        self.opened: list[str] = []
        for m in ("status", "wait_lanes", "open", "step", "close", "ping"):
            setattr(self, m, Remote(getattr(self, "_" + m)))

    async def _status(self) -> Any:
        return status(self.name, self.online)

    async def _wait_lanes(self, timeout_s: float | None = None) -> Any:
        self.waits += 1
        self.waited.set()
        await self.released.wait()
        if self.error is not None:
            raise self.error
        self.online = LANES
        return status(self.name, LANES)

    async def _open(self, conv_id: str, seed: int, prompt: Any, replace: bool = False) -> None:
        self.opened.append(conv_id)

    async def _step(self, conv_id: str, seq: int, inputs: Any) -> StepResult:
        return StepResult(conv_id, seq, (torch.zeros(1),), f"{conv_id}-{seq}", self.name, 1e-4)

    async def _close(self, conv_id: str, moved: bool = False) -> None:
        pass

    async def _ping(self) -> str:
        return self.name


def controller(monkeypatch, worker: FakeWorker) -> ServeController:
    monkeypatch.setattr(controller_mod, "worker_actor", lambda config, name, options=None: worker)
    return ServeController(ControllerConfig(checkpoint=CheckpointPolicy(every=0), health_interval_s=0))


async def settled(ctl: ServeController) -> None:
    """Until the controller's background tasks (the lanes' wait among them) are done."""
    while ctl._tasks:
        await asyncio.wait(list(ctl._tasks), timeout=WAIT_S)


def test_a_warming_worker_admits_its_online_lanes_then_its_full_capacity_and_wakes_a_waiting_open(monkeypatch):
    async def run() -> None:
        w = FakeWorker("w")
        ctl = controller(monkeypatch, w)
        st = await ctl.add_worker(WorkerConfig("fake.cfx", lanes=LANES, capacity=LANES), "w")
        assert (st.lanes_online, st.capacity, st.capacity_full) == (1, 1, LANES)
        await asyncio.wait_for(w.waited.wait(), WAIT_S)  # the controller waits for the other lanes
        await ctl.open("a", seed=1)
        with pytest.raises(AdmissionRefused, match="1/1"):
            await ctl.open("b", seed=2)  # no room while the lanes capture
        waiting = asyncio.ensure_future(ctl.open("c", seed=3, wait_s=10 * WAIT_S))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()  # it waits for room
        assert (await ctl.status())["workers"]["w"]["capacity"] == 1
        w.released.set()  # every lane online
        opened = await asyncio.wait_for(waiting, WAIT_S)  # woken by the new room, not by its own wait_s
        assert opened["worker"] == "w"
        await ctl.open("d", seed=4)
        await ctl.open("e", seed=5)
        with pytest.raises(AdmissionRefused, match="4/4"):
            await ctl.open("f", seed=6)
        view = (await ctl.status())["workers"]["w"]
        assert (view["capacity"], view["lanes_online"], view["conversations"]) == (LANES, LANES, 4)
        assert ctl._workers["w"].status.capacity == LANES
        assert w.opened == ["a", "c", "d", "e"]
        for conv in ("a", "c", "d", "e"):
            assert (await ctl.step(conv, 0, {})).worker == "w"

    asyncio.run(run())


def test_a_failed_capture_keeps_the_capacity_it_joined_with_and_the_worker_serves_on(monkeypatch, caplog):
    async def run() -> None:
        w = FakeWorker("w", error=RuntimeError("capturing lane 2 failed: out of memory"))
        ctl = controller(monkeypatch, w)
        await ctl.add_worker(WorkerConfig("fake.cfx", lanes=LANES, capacity=LANES), "w")
        await ctl.open("a", seed=1)
        w.released.set()
        await settled(ctl)
        assert "capturing lane 2 failed" in caplog.text and "stay offline" in caplog.text
        view = (await ctl.status())["workers"]["w"]
        assert view["alive"] and (view["capacity"], view["lanes_online"]) == (1, 1)
        with pytest.raises(AdmissionRefused, match="1/1"):
            await ctl.open("b", seed=2)
        for seq in range(3):  # the conversation it holds goes on
            assert (await ctl.step("a", seq, {})).seq == seq
        await ctl.close("a")
        await ctl.open("b", seed=2)  # and its one slot is admitted again
        assert w.waits == 1  # the lanes are waited for once, not again at every open

    with caplog.at_level(logging.WARNING, logger="cadence_fx.serve"):
        asyncio.run(run())


def test_a_worker_that_died_while_its_lanes_captured_is_left_dead(monkeypatch):
    async def run() -> None:
        w = FakeWorker("w")
        ctl = controller(monkeypatch, w)
        await ctl.add_worker(WorkerConfig("fake.cfx", lanes=LANES, capacity=LANES), "w")
        await asyncio.wait_for(w.waited.wait(), WAIT_S)
        ctl._worker_died("w", "killed by the test")
        w.released.set()
        await settled(ctl)
        row = ctl._workers["w"]
        assert not row.alive and row.capacity == 1 and row.status.capacity == 1

    asyncio.run(run())


def test_a_worker_with_every_lane_online_at_its_join_is_not_waited_for(monkeypatch):
    async def run() -> None:
        w = FakeWorker("w")
        w.online = LANES
        ctl = controller(monkeypatch, w)
        await ctl.add_worker(WorkerConfig("fake.cfx", lanes=LANES, capacity=LANES), "w")
        await settled(ctl)
        assert not w.waited.is_set() and ctl._workers["w"].capacity == LANES

    asyncio.run(run())


def test_an_adopted_worker_with_lanes_capturing_grows_once_the_restarted_controller_runs(monkeypatch):
    """A restarted controller adopts it at the capacity of its lanes online (in its constructor, no loop
    running) and waits for the others from its first call."""
    import ray

    w = FakeWorker("w")
    w.conversation_table = Remote(lambda: _value({}))
    monkeypatch.setattr(ray.util, "list_named_actors", lambda: ["ctl.w"])
    monkeypatch.setattr(ray, "get_actor", lambda name: w)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [asyncio.run(r) for r in refs])
    ctl = controller(monkeypatch, w)
    ctl._adopt("ctl")
    assert ctl._workers["w"].capacity == 1 and not w.waited.is_set()

    async def run() -> None:
        assert (await ctl.status())["workers"]["w"]["capacity"] == 1
        await asyncio.wait_for(w.waited.wait(), WAIT_S)
        w.released.set()
        await settled(ctl)
        view = (await ctl.status())["workers"]["w"]
        assert (view["capacity"], view["lanes_online"]) == (LANES, LANES)

    asyncio.run(run())
