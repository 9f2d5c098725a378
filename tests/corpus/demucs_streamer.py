"""``denoiser`` 0.1.5 (PyPI, Facebook Research): the real-time Demucs speech denoiser, ``DemucsStreamer``.

Installed with ``pip install --no-deps denoiser==0.1.5`` (pure Python; the wheel-less sdist builds
with setuptools). Without dependencies: it declares ``torchaudio``, ``julius``, ``hydra_core<1.0``,
``hydra_colorlog<1.0``, ``pystoi``, ``sounddevice`` and a git link to ``pesq`` for training,
evaluation and live audio; ``denoiser/__init__.py`` is empty and ``denoiser.demucs`` imports only
``torch`` and its own ``resample``/``utils`` modules.

``DemucsStreamer.feed(wav)`` is upstream's streaming API: it appends ``wav`` to ``pending`` and, for
every ``total_length`` samples pending, denoises one frame and drops ``stride`` samples. Its state
lives in Python attributes of the streamer object:

- ``pending`` (the input not consumed yet): ``cat([pending, wav])`` then ``pending[:, stride:]``;
  upstream's own streaming test feeds ``total_length`` samples first, then ``stride`` at a time, so
  ``total_length - stride`` samples stay pending and every call denoises exactly one frame: a
  ``SlidingWindow`` that starts full, its initial value the stream's first ``total_length - stride``
  samples (the first call's ``stride`` samples complete upstream's first feed);
- ``resample_in`` / ``resample_out``: the sinc resamplers' left contexts, read by
  ``cat([resample_in, frame])`` / ``cat([resample_out, out, extra])`` and then overwritten in place
  with a window of the new frame (``resample_in[:] = frame[:, stride - buffer:stride]``,
  ``resample_out[:] = out[:, -buffer:]``); the step clones them first so that it does not write into
  its inputs;
- ``lstm_state``: the causal LSTM's ``(h, c)``, each ``(layers, 1, dim)``, recurrent (``Ring(1)`` on
  the batch axis); upstream starts from ``None``, which the LSTM takes as zeros, as the stream's
  initial state holds;
- ``conv_state``: per encoder layer the layer's previous outputs, ``cat([prev[..., s:], new])``
  (fixed size after the first frame), and per decoder layer the transposed conv's overlap, read by
  ``x[..., :stride] += prev`` and replaced whole. Upstream has none before the first frame
  (``first = self.conv_state is None``): the step takes empty tensors (extent 0) for that, so the
  first call is its own catalog class.

``normalize=False``: upstream's default normalization (the released checkpoints use it) divides the
frame by ``math.sqrt(self.variance)`` of a running variance tensor, a host float that torch.export
cannot trace (``GuardOnDataDependentSymNode`` on the ``item()``), weighted by ``1 / self.frames``, a
Python counter. Tiny sizes (hidden 4, depth 3, upstream's default kernel, stride, resampling and
look-ahead), random weights, seed 0.
"""

from __future__ import annotations

import torch

import cadence_fx as cf
from tests.corpus import CorpusCase

try:
    from denoiser.demucs import Demucs, DemucsStreamer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("the corpus case demucs_streamer needs `pip install --no-deps denoiser==0.1.5` "
                      "in the test environment") from e

VERSION = "0.1.5"
CALLS = 12


def build_demucs() -> torch.nn.Module:
    torch.manual_seed(0)
    return Demucs(hidden=4, depth=3, normalize=False).eval()


def audio(primed: int, stride: int, calls: int = CALLS) -> torch.Tensor:
    """The stream's samples, (1, primed + calls * stride)."""
    return torch.randn(1, primed + calls * stride, generator=torch.Generator().manual_seed(2))


# user code begins
class DenoiserStep(torch.nn.Module):
    """(wav, pending, resample_in, resample_out, h, c, *conv) -> (denoised, pending', ...): one stride per call."""

    def __init__(self, demucs):
        super().__init__()
        self.demucs = demucs
        self.streamer = DemucsStreamer(demucs)  # upstream's streaming code; its state is set from the inputs

    def forward(self, wav, pending, resample_in, resample_out, h, c, *conv):
        s = self.streamer
        s.pending, s.resample_in, s.resample_out = pending, resample_in.clone(), resample_out.clone()
        s.lstm_state = (h, c)
        s.conv_state = None if conv[0].shape[-1] == 0 else list(conv)  # none before the first frame
        out = s.feed(wav)
        return (out, s.pending, s.resample_in, s.resample_out, *s.lstm_state, *s.conv_state)


def denoiser_contract(s, conv_sizes):
    ring = lambda name, i, axis, size, initial, order: cf.Region(  # noqa: E731
        name, input=name, output=i, clock="sample", axis=axis, order=order, retention=cf.Ring(size), initial=initial)
    regions = [cf.Region("pending", input="pending", output=1, clock="sample", axis=1, order="old_new",
                         retention=cf.SlidingWindow(s.total_length - s.stride), initial=s.total_length - s.stride),
               ring("resample_in", 2, 1, s.resample_buffer, s.resample_buffer, "old_new"),
               ring("resample_out", 3, 1, s.resample_buffer, s.resample_buffer, "old_new"),
               ring("h", 4, 1, 1, 1, None), ring("c", 5, 1, 1, 1, None)]
    depth = s.demucs.depth
    regions += [ring(f"conv_{i}", 6 + i, 2, n, 0, "old_new" if i < depth - 1 else None)  # encoder, decoder overlaps
                for i, n in enumerate(conv_sizes)]
    return cf.Contract(clocks=(cf.Clock("sample", s.stride, "samples per call"),), regions=tuple(regions),
                       wrap=(cf.WHOLE_STEP,))


def export(step, contract, example):
    return cf.export_catalog(step, contract, example)
# user code ends


def conv_state_shapes(demucs: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shapes of upstream's ``conv_state`` after one frame (a throwaway streamer, fed one frame of zeros)."""
    s = DemucsStreamer(demucs)
    with torch.no_grad():
        s.feed(torch.zeros(demucs.chin, s.total_length))
    return [tuple(t.shape) for t in s.conv_state]


def case() -> CorpusCase:
    demucs = build_demucs()
    step = DenoiserStep(demucs).eval()
    s = step.streamer
    shapes = conv_state_shapes(demucs)
    contract = denoiser_contract(s, [shape[-1] for shape in shapes])
    primed = s.total_length - s.stride
    samples = audio(primed, s.stride)
    lstm = torch.zeros(demucs.lstm.lstm.num_layers, 1, demucs.lstm.lstm.hidden_size)
    initial = {"pending": samples[:, :primed], "resample_in": torch.zeros(demucs.chin, s.resample_buffer),
               "resample_out": torch.zeros(demucs.chin, s.resample_buffer), "h": lstm, "c": lstm.clone(),
               **{f"conv_{i}": torch.zeros(*shape[:-1], 0) for i, shape in enumerate(shapes)}}
    inputs = lambda k: {"wav": samples[:, primed + s.stride * k:primed + s.stride * (k + 1)]}  # noqa: E731
    return CorpusCase(
        name="demucs_streamer",
        upstream=f"denoiser {VERSION}: denoiser.demucs.Demucs + DemucsStreamer (feed)",
        step=step,
        contract=contract,
        export=lambda: export(step, contract, {**inputs(0), **initial}),
        inputs=inputs,
        initial=initial,
        calls=CALLS,
        notes="pip install --no-deps denoiser==0.1.5; the streamer's Python attributes set from the inputs each "
              "call; normalize=False (the running variance is a host float)",
    )
