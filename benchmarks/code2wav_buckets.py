"""CUDA-graph wrappers of the kind serving engines ship for Qwen3-Omni's Code2Wav (the ``buckets`` and
``exact`` cells of ``benchmarks/code2wav.py``).

What they do (vLLM-Omni's ``CUDAGraphDecoderWrapper``, ``vllm_omni/model_executor/models/qwen3_tts/
cuda_graph_decoder_wrapper.py``, which its Qwen3-Omni Code2Wav reuses through ``enable_cudagraph``;
SGLang-Omni's ``Code2WavCudaGraphRunner``, ``sglang_omni/models/qwen3_omni/components/code2wav_cuda_graph.py``):
one ``torch.cuda.CUDAGraph`` of the whole eager ``forward`` per length of code frames, every graph in one
shared memory pool, each captured after an eager warm-up run on a static zero input ``(1, Q, frames)``,
the largest first. A call whose length has a graph copies its codes into the static input and replays;
with padding on, a shorter call copies its codes into the first ``T`` frames of the smallest graph that
fits (the rest zeros: code 0 of every codebook) and cuts the output; anything else runs eagerly.

- ``pad=True`` (the ``buckets`` cell): vLLM-Omni's padded buckets, ``(64, 100, 150, 200, 250, 300, 400,
  500)`` above its exact sizes 1..50 (:data:`VLLM_OMNI_BUCKETS`). With ``chunked_decode``'s defaults the
  first chunk (300 frames) hits the 300 graph exactly and every later one (325 with its context) is
  padded to 400: 75 frames decoded for nothing per chunk.
- ``pad=False`` (the ``exact`` cell): graphs of exactly the lengths the stream has, as SGLang-Omni's
  runner captures its serving shapes (B1/T{10,20,30,35}) and vLLM-Omni's later ``compute_capture_sizes``
  (chunk, chunk + context, 300 + 25) do; no padding.

The cut of a padded call: the samples the model itself returns for ``T`` frames (:func:`output_samples`;
what vLLM-Omni's later wrappers cut, the bucket's output less ``(bucket - T) * total_upsample``), so that
the stream can be compared with eager byte for byte. ``cut="frames"`` cuts at ``T * total_upsample``, as
its first wrapper did: that keeps samples the model never returns for ``T`` frames (they depend on the
padding; 555 per chunk at released sizes), and the stream is longer than eager's.

Installed as the model's ``forward`` (:meth:`BucketGraphs.installed`), so the stock ``chunked_decode`` loop
runs unchanged around it (the engines call their own copy of that loop).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any, Iterable, Iterator

import torch

from cadence_fx.adapters.code2wav import output_samples

__all__ = ["VLLM_OMNI_BUCKETS", "BucketGraphs"]

VLLM_OMNI_BUCKETS = (64, 100, 150, 200, 250, 300, 400, 500)


class BucketGraphs:
    """CUDA graphs of one Code2Wav model by length of code frames (see the module docstring).

    ``sizes``: the frame lengths to capture (:meth:`capture` takes only those a stream reaches unless told
    otherwise). ``pad``: a call with no graph of its own length replays the smallest longer one, padded.
    ``cut``: ``"model"`` (the model's own output length) or ``"frames"`` (``frames * total_upsample``).
    """

    def __init__(self, model: Any, sizes: Iterable[int] = VLLM_OMNI_BUCKETS, *, pad: bool = True,
                 cut: str = "model") -> None:
        if cut not in ("model", "frames"):
            raise ValueError(f"cut: 'model' or 'frames', got {cut!r}")
        self.model = model
        self.eager = model.forward  # the stock forward, bound before the wrapper replaces it
        self.sizes = sorted(int(b) for b in sizes)
        self.pad = pad
        self.cut = cut
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_in: dict[int, torch.Tensor] = {}
        self.static_out: dict[int, torch.Tensor] = {}
        self.capture_errors: dict[int, str] = {}
        self.pool: Any = None
        self.paths: Counter = Counter()  # "exact" (a graph of the call's own length), "padded", "eager"
        self.calls: list[dict[str, int | str | None]] = []  # per call: frames, graph length, path

    def bucket_for(self, frames: int) -> int | None:
        """The graph length a call of ``frames`` frames replays (``None``: it runs eagerly)."""
        if not self.pad:
            return frames if frames in self.sizes else None
        return next((b for b in self.sizes if frames <= b), None)

    def capture(self, frames: Iterable[int] | None = None, *, warmup_runs: int = 1) -> dict[str, float]:
        """Capture the graphs the call lengths ``frames`` map to (every size for ``None``), largest first into
        one pool, warmed up and captured on one side stream (one cuBLAS workspace). A graph whose capture
        raises is left out (its calls run eagerly), its error kept in :attr:`capture_errors`. Returns the
        seconds and what the graphs keep: ``allocated_mib`` (static inputs and outputs), ``reserved_mib``
        (with the pool's free blocks)."""
        sizes = sorted(set(self.sizes) if frames is None else {b for f in frames if (b := self.bucket_for(f))})
        device = next(self.model.parameters()).device
        q = self.model.config.num_quantizers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        with torch.no_grad():
            for size in reversed(sizes):
                static_in = torch.zeros(1, q, size, dtype=torch.long, device=device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup_runs):
                        self.eager(static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self.pool, stream=side):
                        static_out = self.eager(static_in)
                except Exception as exc:  # noqa: BLE001 - kept, reported, those calls run eagerly
                    self.capture_errors[size] = f"{type(exc).__name__}: {exc}"[:600]
                    torch.cuda.synchronize()
                    continue
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size], self.static_in[size], self.static_out[size] = graph, static_in, static_out
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        torch.cuda.empty_cache()  # the eager warm-up runs' blocks: cached, not kept by the graphs
        return {"seconds": seconds, "allocated_mib": (torch.cuda.memory_allocated() - allocated) / 2**20,
                "reserved_mib": (torch.cuda.memory_reserved() - reserved) / 2**20}

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``model(codes)``: through the graph of its length, padded with zero codes into a longer one, or eagerly."""
        frames = codes.shape[-1]
        bucket = self.bucket_for(frames)
        if codes.shape[0] != 1 or bucket not in self.graphs:
            self._count(frames, bucket, "eager")
            return self.eager(codes)
        static_in = self.static_in[bucket]
        if frames == bucket:
            static_in.copy_(codes)
        else:
            static_in.zero_()
            static_in[..., :frames].copy_(codes)
        self.graphs[bucket].replay()
        n = output_samples(self.model, frames) if self.cut == "model" else frames * int(self.model.total_upsample)
        self._count(frames, bucket, "exact" if frames == bucket else "padded")
        return self.static_out[bucket][..., :n].clone()

    def _count(self, frames: int, bucket: int | None, path: str) -> None:
        self.paths[path] += 1
        self.calls.append({"frames": frames, "bucket": bucket if path != "eager" else None, "path": path})

    @contextlib.contextmanager
    def installed(self) -> Iterator["BucketGraphs"]:
        """The model's ``forward`` is :meth:`decode` inside the block (``chunked_decode`` calls it per chunk)."""
        self.model.forward = self.decode
        try:
            yield self
        finally:
            del self.model.forward

    def padding(self) -> dict[str, Any]:
        """What the padding cost over the calls so far: frames decoded for nothing, and their share."""
        real = sum(int(c["frames"] or 0) for c in self.calls)
        padded = sum(int(c["bucket"] or 0) - int(c["frames"] or 0) for c in self.calls if c["bucket"] is not None)
        up = int(self.model.total_upsample)
        # what a cut at frames x upsampling (vLLM-Omni's first wrapper's) keeps beyond the model's own output
        beyond = sorted({int(c["frames"] or 0) * up - output_samples(self.model, int(c["frames"] or 0))
                         for c in self.calls if c["path"] != "eager"})
        return {"real_frames": real, "padded_frames": padded,
                "padded_share_of_decoded": padded / (real + padded) if real + padded else 0.0,
                "paths": dict(self.paths), "captured": sorted(self.graphs),
                "frames_cut_extra_samples": beyond, "cut": self.cut, "pad": self.pad,
                "capture_errors": {str(k): v for k, v in self.capture_errors.items()}}
