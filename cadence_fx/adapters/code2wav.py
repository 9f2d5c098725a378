"""Qwen3-Omni's Code2Wav (``transformers`` 5.x ``Qwen3OmniMoeCode2Wav``) bound to cadence_fx.

Code2Wav turns the talker's RVQ codes ``(1, num_quantizers, frames)`` into 24 kHz audio, 1,920
samples per code frame at released sizes. Upstream streams it with ``chunked_decode(codes,
chunk_size=300, left_context_size=25)``: every chunk is decoded whole, with up to
``left_context_size`` frames before it, and only the samples after the context are kept.

:class:`Code2WavStep` is one chunk of that loop as a streaming step, ``(ctx_codes, new_codes) ->
(wav_chunk, next_ctx)``: ``next_ctx`` is the last ``left_context_size`` frames of
``cat([ctx_codes, new_codes])``, which lie wholly in ``new_codes`` once ``chunk_size >
left_context_size``. :func:`code2wav_contract` declares that context as one sliding-window region
that starts empty (the first chunk has no context), and :func:`bind` returns the step, its contract
and one call's example inputs for :func:`cadence_fx.export_catalog` (two catalog classes: context
0, then ``left_context_size``).

:data:`RELEASED` holds the released Code2Wav configuration (``Qwen/Qwen3-Omni-30B-A3B-Instruct``'s
``code2wav_config``, which are also ``Qwen3OmniMoeCode2WavConfig``'s defaults in transformers 5.24);
:func:`build` makes the model from it with random weights, on any device, with no download.
Nothing of upstream is copied: the model, its config and ``chunked_decode`` are imported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from cadence_fx.adapters.streaming import StreamingStep
from cadence_fx.contract import WHOLE_STEP, Clock, Contract, Region, SlidingWindow

if TYPE_CHECKING:  # transformers is imported only where a model is built
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

__all__ = ["CHUNK_SIZE", "LEFT_CONTEXT", "RELEASED", "TINY", "Code2WavStep", "bind", "build", "code2wav_contract",
           "config", "output_samples", "stream_codes"]

#: ``chunked_decode``'s defaults (12.5 code frames per second: 24 s chunks, 2 s of context)
CHUNK_SIZE = 300
LEFT_CONTEXT = 25

#: Qwen3-Omni-30B-A3B-Instruct's ``code2wav_config`` (transformers 5.24's ``Qwen3OmniMoeCode2WavConfig``
#: defaults): 8 sliding-window transformer layers of 1024, 16 codebooks of 2048 codes, upsampling
#: 2 x 2 (ConvNeXt) then 8 x 5 x 4 x 3 (the decoder): 1,920 samples per frame.
RELEASED: Mapping[str, Any] = {
    "codebook_size": 2048, "num_quantizers": 16, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "sliding_window": 72,
    "max_position_embeddings": 8000, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "attention_bias": False,
    "decoder_dim": 1536, "upsample_rates": (8, 5, 4, 3), "upsampling_ratios": (2, 2),
}

#: CPU smoke sizes: every structural part kept (transformer, ConvNeXt upsampling, decoder blocks), x12 per frame.
TINY: Mapping[str, Any] = {
    "codebook_size": 16, "num_quantizers": 4, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "sliding_window": 8, "max_position_embeddings": 64,
    "decoder_dim": 16, "upsample_rates": (2, 3), "upsampling_ratios": (2,),
}


def config(overrides: Mapping[str, Any] | None = None) -> Qwen3OmniMoeCode2WavConfig:
    """A ``Qwen3OmniMoeCode2WavConfig`` of the released values with ``overrides`` applied."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # deferred: optional dependency
        Qwen3OmniMoeCode2WavConfig)

    values = {**RELEASED, **dict(overrides or {})}
    return Qwen3OmniMoeCode2WavConfig(**values)


def build(cfg: Qwen3OmniMoeCode2WavConfig | None = None, *, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen3OmniMoeCode2Wav:
    """``Qwen3OmniMoeCode2Wav(cfg)`` (released config by default) with random weights from ``seed``, built
    on ``device`` (its own initialisation, no download) and cast to ``dtype``; eval mode."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # deferred: optional dependency
        Qwen3OmniMoeCode2Wav)

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3OmniMoeCode2Wav(cfg if cfg is not None else config())
    # floating tensors only (the code offsets stay int64); what upstream's `to` does for an unquantized
    # model, whose decorated signature mypy cannot read
    nn.Module.to(model, dtype=dtype)
    return model.eval()


def output_samples(model: Qwen3OmniMoeCode2Wav, frames: int) -> int:
    """Samples ``model(codes)`` returns for ``frames`` code frames. Each causal transposed convolution of
    the decoder trims ``rate`` samples on either side of its ``(frames + 1) * rate`` outputs, so the
    model emits fewer than ``frames * total_upsample`` (released: 555 fewer) and ``chunked_decode``
    keeps that many fewer per chunk."""
    n = frames * math.prod(model.config.upsampling_ratios)
    for rate in model.config.upsample_rates:
        n = (n - 1) * rate
    return n


class Code2WavStep(StreamingStep):
    """One chunk of ``chunked_decode``: ``(ctx_codes, new_codes) -> (wav_chunk, next_ctx)``.

    ``ctx_codes`` ``(1, Q, c)``: the context kept from the previous call (``c`` = 0 at the first call,
    ``left_context_size`` after); ``new_codes`` ``(1, Q, chunk)``. ``wav_chunk`` is ``model(cat)`` past the
    context's samples, as ``chunked_decode`` keeps it; ``next_ctx`` the last ``left_context_size`` frames.
    """

    inputs = ("ctx_codes", "new_codes")
    state = {"ctx_codes": 1}

    def __init__(self, model: Qwen3OmniMoeCode2Wav, left_context_size: int = LEFT_CONTEXT) -> None:
        super().__init__()
        self.model = model
        self.left_context_size = left_context_size
        self.upsample = int(model.total_upsample)

    def forward(self, ctx_codes: torch.Tensor, new_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.cat([ctx_codes, new_codes], -1)
        wav = self.model(codes)
        return wav[..., ctx_codes.shape[-1] * self.upsample:], codes[..., -self.left_context_size:]


def code2wav_contract(chunk_size: int = CHUNK_SIZE, left_context_size: int = LEFT_CONTEXT) -> Contract:
    """The context as one region on the codes' time axis: a sliding window of ``left_context_size``
    frames, empty at the first call, ``chunk_size`` frames appended per call, the whole step one graph."""
    if not 0 < left_context_size < chunk_size:
        raise ValueError(f"code2wav_contract: needs 0 < left_context_size < chunk_size, got {left_context_size} "
                         f"and {chunk_size} (a context longer than a chunk reaches into the previous one)")
    return Contract(
        clocks=(Clock("frame", chunk_size, "code frame"),),
        regions=(Region("ctx", input="ctx_codes", output=1, clock="frame", axis=-1, order="old_new",
                        retention=SlidingWindow(left_context_size), initial=0, growth=chunk_size),),
        wrap=(WHOLE_STEP,),
    )


def bind(model: Qwen3OmniMoeCode2Wav, chunk_size: int = CHUNK_SIZE, left_context_size: int = LEFT_CONTEXT
         ) -> tuple[Code2WavStep, Contract, dict[str, torch.Tensor]]:
    """The step, its contract and one call's example inputs (on the model's device), ready for
    ``cadence_fx.export_catalog(step, contract, example)``."""
    q = model.config.num_quantizers
    device = next(model.parameters()).device
    example = {"ctx_codes": torch.zeros(1, q, 0, dtype=torch.long, device=device),
               "new_codes": torch.zeros(1, q, chunk_size, dtype=torch.long, device=device)}
    return Code2WavStep(model, left_context_size).eval(), code2wav_contract(chunk_size, left_context_size), example


def stream_codes(model: Qwen3OmniMoeCode2Wav, chunks: int, chunk_size: int = CHUNK_SIZE, *,
                 seed: int = 1) -> torch.Tensor:
    """A stream of ``chunks * chunk_size`` random code frames ``(1, Q, frames)`` on the model's device,
    drawn on the host from ``seed`` (the same codes on every device)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, chunks * chunk_size), generator=g)
    return codes.to(next(model.parameters()).device)
