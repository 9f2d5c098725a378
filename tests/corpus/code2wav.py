"""Qwen3-Omni's Code2Wav (transformers ``Qwen3OmniMoeCode2Wav``): the vocoder that turns the talker's
16-codebook RVQ codes into 24 kHz audio, streamed the way ``chunked_decode`` streams it.

``chunked_decode(codes, chunk_size, left_context_size)`` decodes each chunk of ``chunk_size`` code
frames whole, with the ``left_context_size`` frames before it (none before the first chunk), and keeps
the samples after the context. The streaming step a user writes around it takes the context it kept
and the new codes, and returns the chunk's wav and the next context: the last ``left_context_size``
frames of ``cat([ctx, new])``. With ``chunk_size > left_context_size`` that is the tail of the new
input alone (the "tail of the new input" pattern); the first call has an empty context (extent 0),
every later call a full one, so the catalog has two classes.

Reduced sizes (two 16-wide transformer layers, 4 quantizers of 16 codes, upsampling x12), random
weights from seed 0, on the CPU. The stream of 12 chunks of 10 frames, concatenated, is byte for byte
``model.chunked_decode(codes, 10, 3)`` (checked eagerly, without cadence_fx; the adapter's copy of this
step, ``cadence_fx.adapters.code2wav``, is held to it in ``tests/test_code2wav_bench.py``).
"""

from __future__ import annotations

import torch
import transformers
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

import cadence_fx as cf
from tests.corpus import CorpusCase

CHUNK_SIZE = 10  # code frames per call (chunked_decode's chunk_size; 300 in the released pipeline)
LEFT_CONTEXT = 3  # chunked_decode's left_context_size (25 released); < CHUNK_SIZE
CALLS = 12


def reduced_config() -> Qwen3OmniMoeCode2WavConfig:
    return Qwen3OmniMoeCode2WavConfig(
        codebook_size=16, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
        num_hidden_layers=2, num_quantizers=4, sliding_window=8, max_position_embeddings=64,
        upsample_rates=(2, 3), upsampling_ratios=(2,), decoder_dim=16)


def build_model() -> Qwen3OmniMoeCode2Wav:
    torch.manual_seed(0)
    return Qwen3OmniMoeCode2Wav(reduced_config()).eval()


def stream_codes(config: Qwen3OmniMoeCode2WavConfig, calls: int = CALLS) -> torch.Tensor:
    """The whole stream of codes, ``(1, num_quantizers, calls * CHUNK_SIZE)``."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, config.codebook_size, (1, config.num_quantizers, calls * CHUNK_SIZE), generator=g)


# user code begins
class Code2WavStep(torch.nn.Module):
    """One chunk of ``chunked_decode``: the left context kept from the last call, the new codes."""

    def __init__(self, model, left_context_size):
        super().__init__()
        self.model = model
        self.left_context_size = left_context_size
        self.upsample = int(model.total_upsample)  # samples per code frame

    def forward(self, ctx_codes, new_codes):
        codes = torch.cat([ctx_codes, new_codes], -1)  # (1, Q, ctx + chunk): the chunk with its context
        wav = self.model(codes)
        return wav[..., ctx_codes.shape[-1] * self.upsample:], codes[..., -self.left_context_size:]


def code2wav_contract(chunk_size, left_context_size):
    return cf.Contract(
        clocks=(cf.Clock("frame", chunk_size),),
        regions=(cf.Region("ctx", input="ctx_codes", output=1, clock="frame", axis=-1, order="old_new",
                           retention=cf.SlidingWindow(left_context_size), initial=0, growth=chunk_size),),
        wrap=(cf.WHOLE_STEP,),
    )


def export(step, contract, num_quantizers, chunk_size):
    example = {"ctx_codes": torch.zeros(1, num_quantizers, 0, dtype=torch.long),
               "new_codes": torch.zeros(1, num_quantizers, chunk_size, dtype=torch.long)}
    return cf.export_catalog(step, contract, example)
# user code ends


def case() -> CorpusCase:
    model = build_model()
    config = model.config
    step = Code2WavStep(model, LEFT_CONTEXT).eval()
    contract = code2wav_contract(CHUNK_SIZE, LEFT_CONTEXT)
    codes = stream_codes(config)
    return CorpusCase(
        name="code2wav",
        upstream=f"transformers {transformers.__version__}: Qwen3OmniMoeCode2Wav",
        step=step,
        contract=contract,
        export=lambda: export(step, contract, config.num_quantizers, CHUNK_SIZE),
        inputs=lambda k: {"new_codes": codes[..., k * CHUNK_SIZE:(k + 1) * CHUNK_SIZE].clone()},
        initial={"ctx_codes": torch.zeros(1, config.num_quantizers, 0, dtype=torch.long)},
        calls=CALLS,
        notes="the next context is the tail of the new codes (chunk > context); the first call has none",
    )
