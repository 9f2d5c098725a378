"""Where the cadence benchmark's processes run: which GPU each sees, which sessions it serves, how it starts.

Every child process (an SRc worker, a solo stock run, a stock session) is ``benchmarks/cadence.py``
again (:data:`ENTRY`) with a hidden flag saying which it is, sees one GPU (``CUDA_VISIBLE_DEVICES``,
:func:`child_env`) and gets the model's flags (:func:`passthrough`). For ``g`` GPUs, session ``i``
is on GPU ``i % g`` (:func:`sessions_of`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ENTRY = Path(__file__).resolve().with_name("cadence.py")  # the script every child process runs


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def child_env(visible: list[str], g: int) -> dict:
    """A child's environment: one GPU (``visible[g]``), numbered as NVML numbers them; on a host
    without GPUs (the CPU smoke test) the "GPUs" are just separate processes."""
    env = dict(os.environ)
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible[g]
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def passthrough(args) -> list[str]:
    """The flags every child gets from the coordinator's command line: the model and the traffic."""
    out = ["--model", args.model, "--dtype", args.dtype, "--scripts", str(args.scripts), "--period", str(args.period)]
    if args.model == "moshi":
        out += ["--solo-stock", getattr(args, "solo_stock", None) or "vendor"]
    if args.model == "code2wav":  # the chunk and context shape the catalog and every script's codes
        out += ["--code2wav-chunk", str(args.code2wav_chunk), "--code2wav-context", str(args.code2wav_context)]
    return out + (["--reduced"] if args.reduced else [])


def sessions_of(n: int, g: int, j: int) -> list[int]:
    """The sessions GPU ``j`` of a ``g``-GPU group serves of an N-session run: ``j, j+g, ...``."""
    return [i for i in range(n) if i % g == j]


def spawn(flags: list[str], err: Path, env: dict) -> subprocess.Popen:
    """``benchmarks/cadence.py flags`` in a child process that reports through files, its stderr in
    ``err`` (a file: a pipe nobody reads yet, while the child builds its model, could fill up)."""
    with open(err, "w") as fh:
        return subprocess.Popen([sys.executable, str(ENTRY), *flags], stdout=subprocess.DEVNULL, stderr=fh, env=env)
