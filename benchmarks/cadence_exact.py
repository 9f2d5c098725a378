"""The cadence benchmark's exactness gate: every session's PCM against its script's solo stock run.

Before any cell, one process per GPU runs its share of the scripts alone through the stock code
(:func:`run_solo_child`, ``benchmarks/cadence.py --solo S,S,...``; :func:`solo_stock` is one script),
or the digests are adopted from an earlier report (``--solo-from``, only where every setting they
depend on is this run's). :class:`SoloDigests` is the run's side of both. A row is ``bitexact``
(:func:`bitexact`) when every session served all its chunks and its PCM digest is its script's.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cadence_model import Bench, build_bench, child_setup, device_name
from benchmarks.cadence_placement import child_env, passthrough, spawn
from benchmarks.cadence_traffic import chunks_per_session, script_tokens
from cadence_fx.determinism import sha256_tensors


# --------------------------------------------------------------------------- the solo stock runs
def solo_stock(bench: Bench, script: int, chunks: int) -> str:
    """A script's conversation alone through the stock code: the bytes every session of it must give."""
    step = bench.step
    torch.manual_seed(script)
    st = {k: v.to(v.device, copy=True) for k, v in bench.state0.items()}
    pcm = []
    for f in script_tokens(bench, script, chunks):
        with torch.no_grad():
            out = step.driver_call(*step.next_args(f, st))
        pcm.append(out[0].cpu())
        st = step.carry(out)
    return sha256_tensors(pcm)


def run_solo_child(args) -> None:
    device = child_setup()
    bench = build_bench(args, device)
    chunks = chunks_per_session(args.seconds, args.period)
    t0 = time.perf_counter()
    sha = {s: solo_stock(bench, int(s), chunks) for s in args.solo.split(",") if s}
    Path(args.out).write_text(json.dumps(dict(sha=sha, device=device_name(device), solo_s=time.perf_counter() - t0)))


class SoloDigests:
    """The run's solo digests (``solo``: script -> digest, ``solo_gpu``: script -> the GPU it ran on):
    run by solo processes or adopted from an earlier report. Mixed into :class:`~benchmarks.cadence_run.Run`,
    which holds ``args``, ``visible``, ``chunks``, ``device`` and ``meta``."""

    args: object
    visible: list[str]
    chunks: int
    device: str | None
    meta: dict
    solo: dict[int, str]
    solo_gpu: dict[int, int]

    def start_solo(self, k: int) -> tuple[list, Path]:
        """One process per GPU runs its share of the scripts alone through the stock code."""
        tmp = Path(tempfile.mkdtemp(prefix="cadence-solo-"))
        procs = []
        k = min(k, self.args.scripts) if self.visible else 1  # without GPUs, one process does them all
        for g in range(k):
            scripts = [s for s in range(self.args.scripts) if s % k == g]
            flags = ["--solo", ",".join(map(str, scripts)), "--out", str(tmp / f"solo{g}.json"),
                     "--seconds", str(self.args.seconds)] + passthrough(self.args)
            procs.append((g, spawn(flags, tmp / f"solo{g}.err", child_env(self.visible, g))))
        return procs, tmp

    def finish_solo(self, procs, tmp: Path) -> None:
        for g, p in procs:
            p.wait()
            f = tmp / f"solo{g}.json"
            if p.returncode != 0 or not f.exists():
                raise SystemExit(f"solo stock run on gpu {g} failed:\n{(tmp / f'solo{g}.err').read_text()[-3000:]}")
            got = json.loads(f.read_text())
            self.device = self.device or got["device"]
            for s, sha in got["sha"].items():
                self.solo[int(s)] = sha
                self.solo_gpu[int(s)] = g
        self.meta["solo_s"] = max((json.loads((tmp / f"solo{g}.json").read_text())["solo_s"] for g, _ in procs),
                                  default=None)
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"solo stock runs: {len(self.solo)} scripts x {self.chunks} chunks", file=sys.stderr, flush=True)

    def adopt_solo(self, path: str) -> None:
        """``--solo-from``: the solo digests of an earlier run's report, where every setting they depend
        on is this run's (model, dtype, sizes, chunks, scripts, torch); the device is compared once this
        run knows its own (:meth:`check_solo_device`). Anything else is an error, never a silent gate."""
        rep = json.loads(Path(path).read_text())
        a = self.args
        want = dict(model=a.model, dtype=a.dtype, reduced=a.reduced, chunks_per_session=self.chunks,
                    torch=torch.__version__)
        diff = {k: (rep.get(k), v) for k, v in want.items() if rep.get(k) != v}
        missing = [s for s in range(a.scripts) if str(s) not in (rep.get("solo_sha") or {})]
        if diff or missing:
            raise SystemExit(f"--solo-from {path}: its solo digests do not fit this run "
                             f"({', '.join(f'{k}: report {r!r}, run {v!r}' for k, (r, v) in diff.items())}"
                             f"{'; no digest for script(s) ' + str(missing) if missing else ''})")
        self.solo = {s: rep["solo_sha"][str(s)] for s in range(a.scripts)}
        self.solo_gpu = {s: int((rep.get("solo_gpu") or {}).get(str(s), 0)) for s in range(a.scripts)}
        self.meta.update(solo_from=path, solo_device=rep.get("device"))
        print(f"solo digests of {len(self.solo)} scripts from {path}", file=sys.stderr, flush=True)

    def check_solo_device(self, device: str | None = None) -> None:
        """Digests taken on another GPU model gate nothing here: a kernel choice may differ. ``device``:
        this host's GPU by NVML, before any worker is built (a wrong card stops the run in seconds,
        not after minutes of export), else the device the workers reported."""
        theirs, device = self.meta.get("solo_device"), device or self.device
        if theirs is not None and device is not None and theirs != device:
            raise SystemExit(f"--solo-from: the solo digests were taken on a {theirs}, this run is on a {device}")


# --------------------------------------------------------------------------- the gate
def session_digests(parts: list[dict]) -> dict[int, str]:
    """Session -> PCM digest, over the per-GPU parts of one run."""
    return {int(i): d for p in parts for i, d in p["sha"].items()}


def bitexact(parts: list[dict], n: int, solo: dict[int, str], scripts: int, chunks: int) -> bool:
    """Every one of the ``n`` sessions served all its ``chunks`` and its PCM equals its script's solo run."""
    sha = session_digests(parts)
    served = collections.Counter(int(r[0]) for p in parts for r in p["records"])
    return (len(sha) == n and all(served[i] == chunks for i in range(n))
            and all(solo.get(i % scripts) is not None and sha.get(i) == solo[i % scripts] for i in range(n)))


def script_sha(results: list[dict], scripts: int) -> dict:
    """Script -> the distinct digests its stock sessions gave (one, where the stock code is exact)."""
    digests: dict[int, set] = {}
    for i, r in enumerate(results):
        digests.setdefault(i % scripts, set()).add(r["sha"])
    return {str(k): sorted(v) for k, v in digests.items()}
