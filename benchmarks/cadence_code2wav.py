"""The Code2Wav model of the conversations-per-GPU benchmark (``benchmarks/cadence.py --model code2wav``).

A conversation is Qwen3-Omni's Code2Wav (``transformers`` 5.x ``Qwen3OmniMoeCode2Wav``, the adapter
:mod:`cadence_fx.adapters.code2wav`) streaming the talker's codes as a streaming server decodes them:
every ``--period`` a chunk of ``--code2wav-chunk`` new code frames arrives and its audio must be on the
host before the next one does. The step is :class:`~cadence_fx.adapters.code2wav.Code2WavStep`, one
chunk of upstream ``chunked_decode``: ``(ctx_codes, new_codes) -> (wav, next_ctx)``; its state is the
code context, empty at a conversation's first chunk and ``--code2wav-context`` frames after it.

Why these defaults:

- ``--code2wav-chunk 25``: 2 s of audio per chunk (12.5 code frames per second), the chunk vLLM-Omni's
  streaming Code2Wav stage decodes (``codec_chunk_frames: 25`` in ``talker2code2wav_async_chunk``),
  against ``chunked_decode``'s 300-frame (24 s) offline chunks. ``--period`` defaults to one chunk of
  audio (``chunk / 12.5`` s: 2 s), so a conversation is exactly real time.
- ``--code2wav-context 24``: vLLM-Omni keeps 25 frames of context (``codec_left_context_frames``), as
  ``chunked_decode`` does, but :func:`~cadence_fx.adapters.code2wav.code2wav_contract` needs
  ``0 < context < chunk`` (the context must lie wholly in the last chunk). 24 is the longest context a
  25-frame chunk allows: 49 frames decoded per steady chunk instead of 50, the closest to the served
  configuration (``--code2wav-chunk 50 --code2wav-context 25`` keeps the 25 frames at 4 s chunks).

Sizes: released (216 M parameters, random weights from seed 0, built on the device), or ``TINY`` with
``--reduced`` (alias ``--tiny``) for CPU smoke runs; ``--dtype float32`` or ``bfloat16`` (Code2Wav's
serving dtype). A conversation follows one of ``--scripts`` scripts: its codes are
:func:`~cadence_fx.adapters.code2wav.stream_codes` from the script's seed (``10000 + script``, as every
model's scripts are seeded), cut into chunks; its bytes are its chunks' wav, in order.

Everything else is the benchmark's own, as for the demo decoder: :func:`code2wav_bench` is the
:class:`~benchmarks.cadence_model.Bench` every process builds. The SRc workers export its two catalog
classes (context 0, then ``--code2wav-context``), optimize them with ``--lanes`` lanes and serve; the
stock cell runs the step as its own driver runs it (``driver_call``: the eager forward, one chunk of
``chunked_decode``), one conversation per process; the solo runs and the bit-exact gate compare every
session's wav with its script's solo stock run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.cadence_model import Bench
from cadence_fx.adapters.code2wav import Code2WavStep

FRAME_RATE = 12.5  # code frames per second of audio (24 kHz, 1,920 samples per frame at released sizes)
CHUNK = 25
CONTEXT = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_SEED = 0  # the weights of every process (benchmarks/code2wav.py builds from the same seed)


def configure(args) -> None:
    """Check the code2wav flags (SystemExit with the reason, before any process starts) and default
    ``--period`` to one chunk of audio. Every process calls it: a child gets ``--period`` explicitly."""
    from benchmarks.code2wav import require_transformers

    if args.dtype not in DTYPES:
        raise SystemExit(f"--model code2wav --dtype {args.dtype}: float32 or bfloat16 (Code2Wav's serving dtype)")
    chunk, context = args.code2wav_chunk, args.code2wav_context
    if not 0 < context < chunk:
        raise SystemExit(f"--code2wav-chunk {chunk} --code2wav-context {context}: the step's contract needs "
                         f"0 < context < chunk (the context must lie wholly in the previous chunk)")
    if args.period is None:
        args.period = chunk / FRAME_RATE
    require_transformers()  # a clear message naming the wheels, not an ImportError in every child


def meta(args) -> dict[str, Any]:
    """The report's ``setup.code2wav``: what the solo digests depend on beyond the report's own fields."""
    return dict(chunk_frames=args.code2wav_chunk, context_frames=args.code2wav_context,
                audio_s_per_chunk=args.code2wav_chunk / FRAME_RATE, sizes="tiny" if args.reduced else "released",
                dtype=args.dtype, model_seed=MODEL_SEED)


def check_solo_from(path: str, args) -> None:
    """``--solo-from`` for code2wav: the earlier report's chunk and context must be this run's (the
    generic check compares model, dtype, sizes, chunks per session and torch, not these)."""
    theirs = (json.loads(Path(path).read_text()).get("setup") or {}).get("code2wav") or {}
    ours = meta(args)
    diff = {k: (theirs.get(k), ours[k]) for k in ("chunk_frames", "context_frames", "model_seed")
            if theirs.get(k) != ours[k]}
    if diff:
        raise SystemExit(f"--solo-from {path}: its solo digests do not fit this run ("
                         + ", ".join(f"{k}: report {r!r}, run {v!r}" for k, (r, v) in diff.items()) + ")")


class Code2WavConversation(Code2WavStep):
    """The adapter's step with what the benchmark drives it by: ``fresh`` (a script's code chunks) and
    ``driver_call`` (the stock step as its driver calls it: the eager forward, one chunk of
    ``chunked_decode``). ``next_args`` and ``carry`` are the step's own: the context is output 1."""

    def __init__(self, model: Any, chunk: int, context: int) -> None:
        super().__init__(model, context)
        self.chunk = chunk

    driver_call = Code2WavStep.forward

    def fresh(self, n: int, _spk: Any = None, *, seed: int = 0) -> list[dict]:
        """``n`` chunks of the script's codes: one stream drawn on the host from ``seed``, so every
        process (and device) gets the same codes; each chunk a tensor of its own."""
        from cadence_fx.adapters.code2wav import stream_codes

        codes = stream_codes(self.model, n, self.chunk, seed=seed)
        return [{"new_codes": codes[..., k * self.chunk:(k + 1) * self.chunk].clone()} for k in range(n)]


def code2wav_bench(args, device: str) -> Bench:
    """``build_bench`` for ``--model code2wav``: the step, the empty context every conversation starts
    from, the contract and the catalog export (two classes: context 0, then ``--code2wav-context``)."""
    import cadence_fx as cf
    from cadence_fx.adapters import code2wav as c2w

    model = c2w.build(c2w.config(c2w.TINY if args.reduced else None), device=device, dtype=DTYPES[args.dtype],
                      seed=MODEL_SEED)
    _stock, contract, example = c2w.bind(model, args.code2wav_chunk, args.code2wav_context)
    step = Code2WavConversation(model, args.code2wav_chunk, args.code2wav_context).eval()
    # the first chunk's context: (1, Q, 0). Every session's first call copies it into its own region
    # buffer (nothing, at 0 frames), so one tensor serves every conversation
    state0 = {"ctx_codes": example["ctx_codes"]}
    return Bench(step, None, state0, contract, lambda: cf.export_catalog(step, contract, example))
