"""Corpus case: transformers' Mimi (Kyutai's codec) encoding audio in streaming mode, one chunk per call.

``MimiModel.encode(audio, encoder_cache=..., padding_cache=..., use_streaming=True)`` carries two kinds
of state from one chunk to the next:

- a ``MimiConv1dPaddingCache``: for every causal ``MimiConv1d`` of the SEANet encoder and for the
  downsampling conv, its left context. Each conv runs on ``cat([context, x], 2)``; the cache keeps the
  last ``padding_total`` positions of that concatenation (``x[..., -padding:]`` when the chunk is at
  least that long). A fixed-size context rebuilt whole every call: ``Ring(padding)``,
  ``order="old_new"``, full from the start. Convs with ``padding_total == 0`` (the residual blocks'
  1x1 convs) keep an empty tensor and carry nothing;
- the encoder transformer's ``DynamicCache`` of ``DynamicSlidingWindowLayer``: per layer, keys and
  values ``(1, kv_heads, T, head_dim)``, concatenated old-then-new on axis 2 and cut to the last
  ``sliding_window - 1`` positions: ``SlidingWindow(sliding_window - 1)``, ``order="old_new"``.

The cache objects are Python objects the model rebinds, so the user's step is a functional wrapper:
it builds them from its state inputs (the padding cache's per-layer tensors; the ``DynamicCache`` from
``ddp_cache_data``, the constructor transformers' own export support uses to rebuild one) and returns
their new tensors. Two things a static-shape step must make explicit: the transformer's positions
(upstream takes them from the cache's Python-int ``cumulative_length``, which export would bake in) are
a ``positions`` input; and the first chunk runs through upstream's own streaming encode, whose caches
are the stream's initial state (the downsampling conv pads with ``replicate``: its first context is
the first frame, repeated, which only the first call can know).

Run ``python -m tests.corpus.mimi_encoder`` for the eager check: the step driven over the stream gives
the codes and caches of upstream's own streaming encode, exactly.
"""

from __future__ import annotations

import math

import torch
import transformers
from torch import nn
from transformers import DynamicCache, MimiConfig, MimiModel
from transformers.models.mimi.modeling_mimi import MimiConv1dPaddingCache

import cadence_fx as cf
from tests.corpus import CorpusCase

CHUNK = 32  # audio samples per call: two codec frames (frame_size 16)
CALLS = 14  # calls of the exported step, after the first chunk (upstream's own streaming encode)


def build_model() -> MimiModel:
    """Mimi at reduced sizes (encoder only), random weights."""
    torch.manual_seed(0)
    config = MimiConfig(hidden_size=16, num_filters=4, upsampling_ratios=[4, 2], kernel_size=3, codebook_size=16,
                        codebook_dim=8, num_quantizers=3, vector_quantization_hidden_dimension=8,
                        num_hidden_layers=2, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                        sliding_window=8, max_position_embeddings=256, decoder_config=None)
    return MimiModel(config).eval()


def audio() -> torch.Tensor:
    """The fixed stream: ``CALLS + 1`` chunks of mono audio, ``(1, 1, (CALLS + 1) * CHUNK)``."""
    return torch.randn(1, 1, (CALLS + 1) * CHUNK, generator=torch.Generator().manual_seed(1))


# user code begins
class EncodeStep(nn.Module):
    # (audio, positions, *state) -> (codes, *state'): each conv's left context, then keys and values per layer
    def __init__(self, mimi: MimiModel) -> None:
        super().__init__()
        self.mimi, seanet = mimi, mimi.encoder.encoder_seanet
        self.convs = [seanet.get_submodule(n) for n in seanet._conv1d_layer_names] + [mimi.encoder.downsample]
        self.pads = [int(c.padding_total) for c in self.convs]

    def forward(self, audio, positions, *state):
        pc = MimiConv1dPaddingCache(len(self.pads), self.pads, [c.pad_mode for c in self.convs],
                                    [c.in_channels for c in self.convs])
        it = iter(state)
        pc.padding_cache = [next(it) if p else None for p in self.pads]
        kv = list(it)
        cache = DynamicCache(ddp_cache_data=zip(kv[0::2], kv[1::2]), config=self.mimi.encoder.config)
        out = self.mimi.encode(audio, encoder_cache=cache, padding_cache=pc, use_streaming=True,
                               position_ids=positions)
        return (out.audio_codes, *self.state(out))

    def state(self, out):  # the caches an encode returned, as the step's state tensors
        return [t for t, p in zip(out.padding_cache.padding_cache, self.pads) if p] + [
            t for layer in out.encoder_cache.layers for t in (layer.keys, layer.values)]


def contract_of(step: EncodeStep, frames: int) -> cf.Contract:
    # a conv's input gets CHUNK / (the strides before it) positions per call; the transformer `frames`
    grow = [CHUNK // math.prod(c.conv.stride[0] for c in step.convs[:i]) for i in range(len(step.convs))]
    convs, window = [(p, n) for p, n in zip(step.pads, grow) if p], step.mimi.config.sliding_window - 1
    regions = [cf.Region(f"conv{j}", input=f"state_{j}", output=1 + j, clock="sample", axis=2, order="old_new",
                         retention=cf.Ring(p), initial=p, growth=n) for j, (p, n) in enumerate(convs)]
    regions += [cf.Region(f"kv{j}", input=f"state_{len(convs) + j}", output=1 + len(convs) + j, clock="frame",
                          axis=2, order="old_new", retention=cf.SlidingWindow(window), initial=min(frames, window))
                for j in range(2 * step.mimi.config.num_hidden_layers)]
    return cf.Contract(clocks=(cf.Clock("sample", CHUNK), cf.Clock("frame", frames)), regions=tuple(regions),
                       wrap=(cf.WHOLE_STEP,))
# user code ends


def first_chunk(model: MimiModel, step: EncodeStep, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Upstream's own streaming encode of the first chunk: its codes and the state it leaves, in the step's order."""
    with torch.no_grad():
        out = model.encode(x, use_streaming=True)
    return out.audio_codes, [t.clone() for t in step.state(out)]


def case() -> CorpusCase:
    model = build_model()
    step = EncodeStep(model).eval()
    stream = audio()
    frames = CHUNK // math.prod(model.config.upsampling_ratios)  # encoder frames per call
    _codes, first = first_chunk(model, step, stream[..., :CHUNK])
    contract = contract_of(step, frames)
    names = [f"state_{j}" for j in range(len(first))]

    def inputs(k: int) -> dict[str, torch.Tensor]:
        c = k + 1  # chunk 0 ran through upstream
        return {"audio": stream[..., c * CHUNK:(c + 1) * CHUNK], "positions": torch.arange(frames)[None] + c * frames}

    example = {**inputs(0), **dict(zip(names, first))}
    return CorpusCase(
        name="mimi_encoder",
        upstream=f"transformers {transformers.__version__}: MimiModel.encode (use_streaming=True), "
                 "MimiConv1dPaddingCache, DynamicCache (DynamicSlidingWindowLayer)",
        step=step,
        contract=contract,
        export=lambda: cf.export_catalog(step, contract, example),
        inputs=inputs,
        initial=dict(zip(names, first)),
        calls=CALLS,
        notes="functional wrapper over the padding cache and the DynamicCache; positions an input; "
              "first chunk through upstream's streaming encode",
    )


def _check() -> None:
    """The step (eager, and its exported programs) over the stream against upstream's own streaming encode."""
    c = case()
    model, stream = build_model(), audio()
    want = []  # upstream: chunk by chunk, feeding back the cache objects it returns
    with torch.no_grad():
        ec = pc = None
        for k in range(CALLS + 1):
            out = model.encode(stream[..., k * CHUNK:(k + 1) * CHUNK], encoder_cache=ec, padding_cache=pc,
                               use_streaming=True)
            ec, pc = out.encoder_cache, out.padding_cache
            want.append(out.audio_codes)
        state_want = c.step.state(out)
        # upstream's streaming encode is itself the non-streaming encode of the whole stream, chunked
        assert torch.equal(torch.cat(want, -1), model.encode(stream).audio_codes)
    eps = c.export()
    for label, fn in (("eager step", c.step), ("exported", cf.reference(eps))):
        state = dict(c.initial)
        names = [n for n in state]
        got = []
        with torch.no_grad():
            for k in range(c.calls):
                o = fn(*c.inputs(k).values(), *[state[n] for n in names])
                got.append(o[0])
                state = dict(zip(names, o[1:]))
        same = all(torch.equal(a, b) for a, b in zip(want[1:], got))
        same_state = all(torch.equal(a, b) for a, b in zip(state_want, state.values()))
        print(f"{label}: codes {tuple(got[0].shape)} x {len(got)} calls equal upstream streaming: {same}; "
              f"final state equal: {same_state}")
        assert same and same_state
    print("catalog classes:", cf.call_classes(c.contract))


if __name__ == "__main__":
    _check()
