"""A worker's readiness: its capacity (measured at start, or given) and the lanes still capturing.

A worker whose config sets ``serve_from_lanes`` is ready once that many lanes are captured; the others
capture beside traffic (:class:`~cadence_fx.runtime.warmup.LaneWarmup`), and the capacity it admits
grows with the lanes online. A mixin of :class:`~cadence_fx.serve.worker.ConversationWorker`, apart from
the conversations' life kept there, as :mod:`cadence_fx.serve.transfer` is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cadence_fx.serve.calibration import Calibration, given_capacity, measure_capacity

if TYPE_CHECKING:
    from cadence_fx.serve.worker import WorkerStatus

__all__ = ["Readiness"]


class Readiness:
    """What :class:`ConversationWorker` knows of its own readiness (``prog``, ``config``, ``calibration``,
    ``_warming``, ``_times`` and ``_t0`` are the worker's)."""

    if TYPE_CHECKING:
        import threading

        prog: Any
        config: Any
        device: torch.device
        calibration: Calibration
        _warming: Any
        _times: dict[str, float]
        _t0: float
        _lock: threading.Lock
        _closed: Any
        _chunk_ms: Any
        _chunks: int
        _example: Any

        def open(self, conv_id: str, seed: int | None = None, prompt: Any = None, *, replace: bool = False,
                 force: bool = False, epoch: int = 0) -> int: ...
        def step(self, conv_id: str, seq: int, inputs: Any, epoch: int | None = None) -> Any: ...
        def close(self, conv_id: str, *, moved: bool = False) -> None: ...
        def status(self) -> WorkerStatus: ...

    @property
    def capacity(self) -> int:
        """Conversations admitted now: the calibrated (or given) capacity, in proportion to the lanes
        online while the others capture (at least 1 once one is)."""
        full, lanes = self.calibration.capacity, len(self.prog.lanes.lanes)
        online = self.prog.lanes.online()
        return full if online >= lanes else max(1, full * online // lanes) if online else 0

    def wait_lanes(self, timeout_s: float | None = None) -> "WorkerStatus":
        """Block until every lane is captured and serving; the status then. Raises :class:`TimeoutError`
        after ``timeout_s``, and :class:`RuntimeError` when a capture beside traffic failed (the lanes
        online keep serving)."""
        if self._warming is not None:
            self._warming.wait(timeout_s)
        return self.status()

    def _lanes_ready_s(self) -> float | None:
        w = self._warming
        if w is None:
            return self._times["ready_s"]
        if not w.done or w.error is not None or w.seconds is None:
            return None
        return w.started - self._t0 + w.seconds

    def _warmup_error(self) -> str | None:
        w = self._warming
        return None if w is None or w.error is None else repr(w.error)

    def _calibrate(self) -> Calibration:
        cfg = self.config
        if cfg.capacity is not None:
            return given_capacity(cfg.capacity, cfg.deadline_s)
        per = sum(rp.session_bytes for rp in self.prog.plan.regions)
        memory = None
        if self.device.type == "cuda" and per > 0:
            memory = int(torch.cuda.mem_get_info(self.device)[0] * cfg.memory_margin // per)
        count = [0]

        def new_conversation() -> tuple[Any, Any]:
            count[0] += 1
            cid = f"__calibration-{count[0]}"
            self.open(cid, seed=count[0], prompt=cfg.prompt, force=True)
            seq = [0]

            def run() -> None:
                self.step(cid, seq[0], self._example)
                seq[0] += 1

            def close() -> None:
                self.close(cid)
                with self._lock:
                    self._closed.pop(cid, None)
            return run, close

        cal = measure_capacity(new_conversation, lanes=len(self.prog.lanes.lanes), deadline_s=cfg.deadline_s,
                               max_n=cfg.calibrate_max, rounds=cfg.calibrate_rounds, memory_bound=memory)
        with self._lock:  # calibration traffic is not traffic
            self._chunk_ms.clear()
            self._chunks = 0
        return cal

