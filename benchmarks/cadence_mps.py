"""An MPS control daemon of the cadence run's own, for SRc workers that share a GPU (``--mps``).

Without MPS, the contexts of several processes on one GPU take turns (time slices): a kernel of one
process never runs beside a kernel of another, so ``--procs-per-gpu`` > 1 gains host parallelism (an
interpreter per process) and loses kernel concurrency across them. Under MPS the processes' work goes
through one server context and runs side by side, as one process's streams do.

The daemon gets pipe and log directories of its own (``CUDA_MPS_PIPE_DIRECTORY``,
``CUDA_MPS_LOG_DIRECTORY`` in a temporary folder), so only the processes given :meth:`MpsDaemon.env`
(the SRc workers) are its clients: the stock processes and solo runs stay ordinary contexts, the way
their own driver runs them. The GPU's compute mode and every other setting are left as they are.

A daemon that does not start, or whose first client cannot make a context (a machine whose driver
refuses MPS), is stopped and reported (:attr:`MpsDaemon.facts`): the workers then run without it and
their rows say ``mps: false``. Nothing is guessed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["CONNECTION_POOL", "DRIVER_CONNECTIONS", "MpsDaemon", "client_connections", "control_binary"]

# where the driver's tools are mounted on hosts whose PATH does not name them
_DRIVER_BIN = ("/usr/local/nvidia/bin", "/usr/bin")

# Under MPS a client owns the work queues it asks for (CUDA_DEVICE_MAX_CONNECTIONS) out of one pool per
# GPU, and a client the pool cannot serve fails its first CUDA call with an out-of-memory error, however
# much memory is free (NVIDIA's MPS docs; session 34's probe, scripts/sessions/s34_conn_probe.py: three
# clients of 32 and six of 16 started, a fourth of 32 did not). 96 is the most the probe saw served.
CONNECTION_POOL = 96
DRIVER_CONNECTIONS = 8  # what a client gets without the variable


def client_connections(requested: int, clients: int, pool: int = CONNECTION_POOL) -> int:
    """The connections each of ``clients`` MPS clients of one GPU may ask for: ``requested`` (0: the
    driver's 8) unless ``clients`` of that many would not fit ``pool``, then the most that fits (at
    least 1). Raises ``ValueError`` for fewer than one client."""
    if clients < 1:
        raise ValueError(f"client_connections: {clients} clients")
    want = requested or DRIVER_CONNECTIONS
    return max(1, min(want, pool // clients))


_PROBE = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize(); print('ok')"


def control_binary() -> str | None:
    """The ``nvidia-cuda-mps-control`` of this host, or None."""
    found = shutil.which("nvidia-cuda-mps-control")
    if found:
        return found
    for d in _DRIVER_BIN:
        path = os.path.join(d, "nvidia-cuda-mps-control")
        if os.access(path, os.X_OK):
            return path
    return None


class MpsDaemon:
    """Start with :meth:`start`; give clients :meth:`env`; :meth:`stop` when the SRc cell is over."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.binary: str | None = None
        self.running = False
        self.facts: dict = dict(requested=True, running=False)

    def _env(self) -> dict:
        assert self.dir is not None
        return dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(self.dir, "pipe"),
                    CUDA_MPS_LOG_DIRECTORY=os.path.join(self.dir, "log"))

    def _control(self, command: str, timeout: float = 20.0) -> str:
        assert self.binary is not None
        proc = subprocess.run([self.binary], input=command + "\n", capture_output=True, text=True,
                              env=self._env(), timeout=timeout)
        return (proc.stdout + proc.stderr).strip()

    def start(self, gpus_visible: bool) -> bool:
        """Start the daemon and make one probe client's context through it; True when both worked."""
        if not gpus_visible:
            self.facts.update(error="no GPU visible: MPS needs one")
            return False
        self.binary = control_binary()
        if self.binary is None:
            self.facts.update(error="no nvidia-cuda-mps-control on PATH or in " + ", ".join(_DRIVER_BIN))
            return False
        self.dir = tempfile.mkdtemp(prefix="cadence-mps-")
        for sub in ("pipe", "log"):
            os.makedirs(os.path.join(self.dir, sub))
        try:
            started = subprocess.run([self.binary, "-d"], capture_output=True, text=True, env=self._env(), timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.facts.update(error=f"the daemon did not start: {e!r}")
            return False
        if started.returncode != 0:
            self.facts.update(error=f"the daemon did not start (rc {started.returncode}): "
                                    f"{(started.stdout + started.stderr).strip()[-500:]}")
            return False
        self.running = True
        try:
            probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=self._env(),
                                   timeout=60)
            ok = probe.returncode == 0 and probe.stdout.strip().endswith("ok")
            detail = (probe.stdout + probe.stderr).strip()[-500:]
        except subprocess.TimeoutExpired:
            ok, detail = False, "the probe client timed out after 60 s"
        if not ok:
            self.facts.update(error=f"a client could not make a context through the daemon: {detail}",
                              log=self._log_tail())
            self.stop()
            return False
        self.facts.update(running=True, binary=self.binary, servers=self._control("get_server_list"))
        return True

    def env(self, base: dict) -> dict:
        """``base`` with this daemon's pipe and log directories: a process started with it is a client."""
        if not self.running:
            return base
        mine = self._env()
        return dict(base, CUDA_MPS_PIPE_DIRECTORY=mine["CUDA_MPS_PIPE_DIRECTORY"],
                    CUDA_MPS_LOG_DIRECTORY=mine["CUDA_MPS_LOG_DIRECTORY"])

    def note_clients(self) -> None:
        """Record the daemon's servers once the workers are up (an empty list: no client connected)."""
        if self.running:
            try:
                self.facts["servers_with_workers"] = self._control("get_server_list")
            except (OSError, subprocess.TimeoutExpired) as e:
                self.facts["servers_with_workers"] = repr(e)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "log", "control.log")) as f:
                return f.read()[-500:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.running:
            try:
                self._control("quit")
            except (OSError, subprocess.TimeoutExpired) as e:
                self.facts["stop_error"] = repr(e)
            self.running = False
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
