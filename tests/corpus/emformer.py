"""torchaudio 2.9.1's ``Emformer`` (streaming transformer, memory banks and left-context key/value caches).

Upstream streams through ``Emformer.infer(input, lengths, states)``: ``input`` is one segment of
``segment_length`` frames right-padded with ``right_context_length`` look-ahead frames, ``states`` a
list per layer of ``[memory, left_context_key, left_context_val, past_length]``. Upstream keeps each
cache in a fixed-size, zero-padded tensor (``max_memory_size`` and ``left_context_length`` positions)
and reads the filled part off the counter with ``past_length.item()`` (``_EmformerLayer._unpack_state``):
``min(left_context_length, past)`` key/value positions, ``min(max_memory_size, ceil(past /
segment_length))`` memory slots. On every call it rebuilds the caches whole:
``cat([memory, summary])[-max_memory_size:]``, and the left context is the last
``left_context_length`` positions of ``cat([lc_key, cat([key[:m + r], lc_key_filled, key[m + r:]])[m + r:]])``
(the cache appears twice, once as a middle operand; with ``left_context_length >= segment_length`` the
kept positions are the old tail plus the new segment's keys).

The user's step keeps upstream's code and gives it static shapes, one program per catalog class:

- each cache is passed at its *filled* extent (``0`` at the first call, then growing by one segment
  until full: ``SlidingWindow``, ``initial=0``); the step zero-pads it to upstream's fixed size and
  returns the filled suffix of upstream's new state;
- ``past_length`` is not an input: it is a function of the class's extents (``max(lc extent,
  segment_length * memory extent)`` reproduces upstream's counter on every slice it takes), built as
  a ``torch.tensor`` constant so ``.item()`` folds at export. Passing upstream's state as it is (the
  zero-padded caches as ``Ring`` regions, the counter as a ``Ring(1)`` region) exports too, as one
  class, but ``.item()`` on the counter is then a host read every call and makes every cache slice,
  the attention mask and the matrix products data-dependent (unbacked sizes): not a static-shape
  program;
- ``lengths`` is not an input for the same reason: upstream computes a slice bound from its values
  (``T - torch.max(lengths).int() - summary.size(0)`` in ``_EmformerAttention._forward_impl``); every
  chunk is full, so the step builds it as a constant. Upstream's returned ``output_lengths`` (that
  constant minus the right context) and ``past_length`` (the counter plus the segment) are dropped.

Tiny sizes, random weights, seed 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cadence_fx as cf
from tests.corpus import CorpusCase
from tests.corpus import _torchaudio

DIM, HEADS, FFN, LAYERS = 16, 2, 32, 2
SEG, LC, RC, MEM = 4, 8, 1, 3
CALLS = 12


def build_emformer() -> torch.nn.Module:
    torch.manual_seed(0)
    ta = _torchaudio.load()
    return ta.emformer.Emformer(DIM, HEADS, FFN, LAYERS, SEG, left_context_length=LC, right_context_length=RC,
                                max_memory_size=MEM).eval()


def stream(calls: int = CALLS) -> torch.Tensor:
    """The feature frames of the whole stream, (1, calls * SEG + RC, DIM)."""
    return torch.randn(1, calls * SEG + RC, DIM, generator=torch.Generator().manual_seed(1))


# user code begins
class EmformerStep(torch.nn.Module):
    """(chunk, *state) -> (frames, *state'); per layer: memory, left-context key, value, at their filled extents."""

    def __init__(self, emformer):
        super().__init__()
        self.emformer = emformer

    def forward(self, chunk, *state):
        em = self.emformer
        pad = lambda t, n: t if t.shape[0] == n else F.pad(t, (0, 0, 0, 0, n - t.shape[0], 0))  # noqa: E731
        past = max(state[1].shape[0], em.segment_length * state[0].shape[0])  # upstream's past_length
        states = [[pad(m, em.max_memory_size), pad(k, em.left_context_length), pad(v, em.left_context_length),
                   torch.tensor([[past]], dtype=torch.int32)] for m, k, v in zip(state[0::3], state[1::3], state[2::3])]
        out, _, new = em.infer(chunk, torch.tensor([chunk.shape[1]]), states)
        lc = min(em.left_context_length, state[1].shape[0] + em.segment_length)  # filled after this call
        keep = (min(em.max_memory_size, state[0].shape[0] + 1), lc, lc)  # zip drops past_length
        return (out, *[t if t.shape[0] == n else t[-n:] for s in new for t, n in zip(s, keep)])


def emformer_contract(layers):
    regions = []
    for i in range(layers):
        regions += [cf.Region(f"layer{i}_{what}", input=f"state_{3 * i + j}", output=1 + 3 * i + j, clock=clock,
                              axis=0, order="old_new", retention=cf.SlidingWindow(size), initial=0)
                    for j, (what, clock, size) in enumerate((("memory", "segment", MEM), ("lc_key", "frame", LC),
                                                             ("lc_val", "frame", LC)))]
    return cf.Contract(clocks=(cf.Clock("frame", SEG, "feature frames per segment"), cf.Clock("segment", 1)),
                       regions=tuple(regions), wrap=(cf.WHOLE_STEP,))


def export(step, contract, chunk):
    example = {"chunk": chunk, **{r.input: torch.zeros(0, 1, DIM) for r in contract.regions}}
    return cf.export_catalog(step, contract, example)
# user code ends


def case() -> CorpusCase:
    step = EmformerStep(build_emformer()).eval()
    contract = emformer_contract(LAYERS)
    frames = stream()
    return CorpusCase(
        name="emformer",
        upstream=f"torchaudio {_torchaudio.VERSION}: torchaudio.models.Emformer (infer)",
        step=step,
        contract=contract,
        export=lambda: export(step, contract, frames[:, :SEG + RC]),
        inputs=lambda k: {"chunk": frames[:, SEG * k:SEG * k + SEG + RC]},
        initial={r.input: torch.zeros(0, 1, DIM) for r in contract.regions},
        calls=CALLS,
        notes="torchaudio's model files loaded without its C extension; caches passed at their filled extents "
              "(zero-padded for upstream), past_length and lengths built as constants from the class",
    )
