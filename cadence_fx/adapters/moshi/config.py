"""What a Moshi stream is made of: the LM and Mimi configurations and the sampling settings.

The released configurations are read from the upstream package (``moshi.models.loaders._lm_kwargs``
and ``_mimi_config``, what ``get_moshi_lm`` / ``get_mimi`` use when no config file is given);
:meth:`MoshiConfig.reduced` overrides the sizes for CPU tests and keeps every structural choice
(gating, RMS norms in fp32, RoPE, the depformer's weights per step, the delays, the ring caches,
Mimi's SEANet ratios, so one frame is still 1920 samples at 24 kHz).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["MoshiConfig"]


@dataclass(frozen=True)
class MoshiConfig:
    """Sizes, dtype and sampling of one Moshi stream. The defaults are the released model
    (``kyutai/moshiko-pytorch-bf16``: 7B temporal transformer, context 3000; Mimi with 8 codebooks)
    with ``LMGen``'s default sampling (temperature 0.8 / 0.7 text, top-k 250 / 25).

    Attributes:
        lm_overrides: entries replacing those of the released ``_lm_kwargs``.
        mimi_overrides: per section (``seanet``, ``quantizer``, ``transformer``) entries replacing
            those of the released ``_mimi_config``.
        dtype: the LM's dtype (bf16 released; Mimi stays fp32 as ``get_mimi`` builds it).
        num_codebooks: Mimi codebooks used (8 for moshiko: the LM models 8 per stream).
        batch_size: streams per step (the batch dimension of every state tensor).
        seed: every builder seeds its own random weights from it.
    """

    lm_overrides: Mapping[str, Any] = field(default_factory=dict)
    mimi_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    num_codebooks: int = 8
    batch_size: int = 1
    use_sampling: bool = True
    temp: float = 0.8
    temp_text: float = 0.7
    top_k: int = 250
    top_k_text: int = 25
    seed: int = 0

    def lm_kwargs(self, up: types.SimpleNamespace) -> dict[str, Any]:
        """``get_moshi_lm``'s ``lm_kwargs``: the released ones with :attr:`lm_overrides` applied."""
        kw = dict(up.loaders._lm_kwargs)
        unknown = set(self.lm_overrides) - set(kw) - {"text_card_out", "existing_text_end_padding_id"}
        if unknown:
            raise ValueError(f"MoshiConfig.lm_overrides: unknown LM arguments {sorted(unknown)}")
        kw.update(self.lm_overrides)
        return kw

    def mimi_config(self, up: types.SimpleNamespace) -> dict[str, Any]:
        """``get_mimi``'s ``mimi_config``: the released one with :attr:`mimi_overrides` applied per section."""
        base = up.loaders._mimi_config
        cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
        for section, over in self.mimi_overrides.items():
            if section not in cfg or not isinstance(cfg[section], dict):
                raise ValueError(f"MoshiConfig.mimi_overrides: unknown section {section!r}")
            unknown = set(over) - set(cfg[section])
            if unknown:
                raise ValueError(f"MoshiConfig.mimi_overrides[{section!r}]: unknown arguments {sorted(unknown)}")
            cfg[section].update(over)
        return cfg

    @classmethod
    def reduced(cls, *, context: int = 4, mimi_context: int = 3, **overrides: Any) -> "MoshiConfig":
        """A configuration for CPU tests: a 2-layer temporal transformer of width 64 whose ring holds
        ``context`` frames (so a stream of a few frames wraps it), a 2-layer depformer, vocabularies
        of 32 audio and 100 text tokens, 2 codebooks per audio stream (the released model has 8: the
        depformer's per-codebook loop is what export unrolls, so this keeps export quick) with the
        released delay pattern (text and first codebook undelayed, the others one frame late); Mimi
        at width 32 with 2-layer transformers whose rings hold ``mimi_context`` frames. fp32, so the
        CPU runs it quickly; sampling on."""
        lm = dict(dim=64, text_card=100, card=32, n_q=4, dep_q=2, delays=[0, 0, 1, 0, 1], num_heads=4, num_layers=2,
                  context=context, depformer_dim=32, depformer_dim_feedforward=int(4.125 * 32),
                  depformer_num_heads=2, depformer_num_layers=2)
        mimi = {"seanet": dict(dimension=32, n_filters=4),
                "quantizer": dict(dimension=16, bins=32, input_dimension=32, output_dimension=32),
                "transformer": dict(d_model=32, num_heads=2, num_layers=2, dim_feedforward=64, context=mimi_context,
                                    input_dimension=32, output_dimensions=[32])}
        base: dict[str, Any] = dict(lm_overrides=lm, mimi_overrides=mimi, dtype=torch.float32, num_codebooks=2, top_k=8,
                                    top_k_text=8)
        base.update(overrides)
        return cls(**base)
