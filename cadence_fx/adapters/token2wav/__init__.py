"""The Token2Wav adapter: the stock Step-Audio2 / MiniCPM-o streaming decoder as cadence_fx steps.

What one streaming call of the stock driver (``Token2wav.stream`` in ``stepaudio2/token2wav.py``)
does, and what the exported step reproduces:

1. ``flow.inference_chunk``: the upsampling conformer encoder (``forward_chunk``) on 25 + 3
   lookahead tokens, then the 10-step Euler CFM loop, each step one call of the DiT estimator
   with CFG batch 2;
2. the driver's trim of both attention caches to ``[:prompt] + [-100:]`` frames (0.1.2 trims
   the packed conformer cache as one tensor; 1.0.7 trims its token-rate and mel-rate halves
   separately and repacks them);
3. 0.1.2: HiFT vocoding with the driver's 8-frame mel cache, 3840-sample source cache and
   the Hamming cross-fade with the previous chunk's speech tail. 1.0.7 streams through a
   ``BoundedVocoder`` whose state is host-side integer bookkeeping; it is not exportable to a
   finite catalog and runs after the step (:func:`bounded_vocoder_stream`), its stateless
   ``decode`` optionally as a replayed catalog
   (:func:`cadence_fx.adapters.bounded_vocoder.replay_bounded_vocoder`).

Everything model-side is the upstream code, imported (:mod:`cadence_fx.adapters.stepaudio2`). The
modules here, by concern:

- :mod:`~cadence_fx.adapters.token2wav.config`: :class:`Token2WavConfig`, the driver releases,
  the paths of the wrapped callables;
- :mod:`~cadence_fx.adapters.token2wav.build`: the stock modules with seeded random weights;
- :mod:`~cadence_fx.adapters.token2wav.routing`: proxies that make the upstream ``forward_chunk``
  calls visible to ``torch.export`` (:func:`routed`), installed for an export only;
- :mod:`~cadence_fx.adapters.token2wav.driver`: the driver logic of ``token2wav.py`` (a module that
  cannot be imported without onnxruntime, torchaudio and the ASR tokenizer): trims, HiFT
  streaming and fade, the 1.0.7 ``BoundedVocoder`` stream, the eager end-to-end stock stream;
- :mod:`~cadence_fx.adapters.token2wav.steps`: the exported steps (:class:`Token2WavStep`, whose
  export and stock paths share one spelled-out flow, :class:`DiTStep`, :class:`EncoderStep`);
- :mod:`~cadence_fx.adapters.token2wav.contracts`: their contracts;
- :mod:`~cadence_fx.adapters.token2wav.planning`: ``cadence-fx plan token2wav``.

Per-class export and stream driving are model-agnostic (:mod:`cadence_fx.adapters.streaming`,
re-exported here): :meth:`Token2WavStep.export_context` is the step's hook that installs the proxies.
"""

from cadence_fx.adapters.streaming import CatalogReference, StreamingStep, export_step_catalog, run_stream, signature
from cadence_fx.adapters.token2wav.build import (build_causal_vocoder, build_dit, build_encoder, build_flow,
                                                 build_vocoder)
from cadence_fx.adapters.token2wav.config import (CFM_PATH, ENCODER_PATH, ESTIMATOR_PATH, VOCODER_PATH, Driver,
                                                  Granularity, Token2WavConfig)
from cadence_fx.adapters.token2wav.contracts import dit_step_contract, encoder_step_contract, token2wav_contract
from cadence_fx.adapters.token2wav.driver import (bounded_vocoder_stream, fade_in_out, hift_stream,
                                                  new_bounded_stream, run_stock_stream, speech_window,
                                                  trim_conformer_cache, trim_estimator_cache)
from cadence_fx.adapters.token2wav.planning import export_plan_step, plan_target
from cadence_fx.adapters.token2wav.routing import CFMChunk, EncoderChunk, EstimatorChunk, VocoderCall, routed
from cadence_fx.adapters.token2wav.steps import DiTStep, EncoderStep, Token2WavStep, example_prompt

__all__ = [
    "bounded_vocoder_stream", "build_causal_vocoder", "build_dit", "build_encoder", "build_flow",
    "build_vocoder", "CatalogReference", "CFM_PATH", "CFMChunk", "dit_step_contract", "DiTStep", "Driver",
    "ENCODER_PATH", "encoder_step_contract", "EncoderChunk", "EncoderStep", "ESTIMATOR_PATH",
    "EstimatorChunk", "example_prompt", "export_plan_step", "export_step_catalog", "fade_in_out", "Granularity",
    "hift_stream", "new_bounded_stream", "plan_target", "routed", "run_stock_stream", "run_stream", "signature",
    "speech_window", "StreamingStep", "token2wav_contract", "Token2WavConfig", "Token2WavStep",
    "trim_conformer_cache", "trim_estimator_cache", "VOCODER_PATH", "VocoderCall",
]
