"""What a Token2Wav stream is made of: its dimensions, its schedule and the stock driver's release."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cadence_fx.contract import HeadTail

__all__ = ["CFM_PATH", "Driver", "ENCODER_PATH", "ESTIMATOR_PATH", "Granularity", "Token2WavConfig",
           "VOCODER_PATH"]

Driver = Literal["0.1.2", "1.0.7"]
Granularity = Literal["chunk", "step"]

# Paths of the wrapped callables in the exported step (see :func:`cadence_fx.adapters.token2wav.routed`).
ENCODER_PATH = "flow.encoder"
CFM_PATH = "flow.decoder"
ESTIMATOR_PATH = "flow.decoder.upstream.estimator"
VOCODER_PATH = "vocoder"


@dataclass(frozen=True)
class Token2WavConfig:
    """Dimensions and stream schedule. The defaults are the released model and the stock driver.

    The DiT and the CFM workspaces hard-code 16 layers x 8 heads x 128 (k and v of head size 64)
    and 1024 conv channels, so the estimator keeps its released width in every configuration;
    :meth:`reduced` shrinks the encoder and the vocoder, the stream lengths and the solver steps.
    """

    # UpsampleConformerEncoderV2
    input_size: int = 512
    output_size: int = 512
    pre_lookahead_len: int = 3
    num_blocks: int = 6
    num_up_blocks: int = 4
    up_stride: int = 2
    attention_heads: int = 8
    linear_units: int = 2048
    # DiT estimator (in_channels = x, mu, spks, cond: 4 x mel_channels)
    mel_channels: int = 80
    dit_depth: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 64
    dit_hidden: int = 512
    # CausalConditionalCFM
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10
    # flow
    vocab_size: int = 6561
    spk_embed_dim: int = 192
    # HiFTGenerator (hop 480 samples per mel frame at 24 kHz with the default upsampling)
    hift_base_channels: int = 512
    # stream schedule of the stock driver
    prompt_tokens: int = 151
    lookahead_pad_token: int = 4218
    chunk_tokens: int = 25
    history_frames: int = 100  # the driver keeps [:prompt] + [-100:] frames
    mel_cache_frames: int = 8  # HiFT driver: 8-frame mel cache
    hop_samples: int = 480
    # frames the stock workspaces reserve (CFM (16,16,2,8,1000,128), DiT (16,2,8,1000,128));
    # None keeps the stock 1000. Only the capacity changes, never a computed value.
    workspace_frames: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.history_frames % self.up_stride:
            # the packed conformer cache keeps token-rate halves: the kept history must split evenly
            raise ValueError(f"Token2WavConfig.history_frames ({self.history_frames}) must be a multiple of "
                             f"up_stride ({self.up_stride})")
        need = self.prompt_frames + self.history_frames + self.chunk_frames
        if self.workspace_frames is not None and self.workspace_frames < need:
            raise ValueError(f"Token2WavConfig.workspace_frames ({self.workspace_frames}) is smaller than the longest "
                             f"history the stream writes (prompt + history + chunk = {need} frames)")
        if self.output_size % self.attention_heads:
            raise ValueError("Token2WavConfig.output_size must be divisible by attention_heads")

    @property
    def up_rate(self) -> int:
        return self.up_stride

    @property
    def prompt_frames(self) -> int:
        """Mel frames of the prompt (302 for 151 tokens)."""
        return self.prompt_tokens * self.up_rate

    @property
    def chunk_frames(self) -> int:
        """Mel frames one call adds (50 for 25 tokens)."""
        return self.chunk_tokens * self.up_rate

    @property
    def call_tokens(self) -> int:
        """Tokens per streaming call: new tokens plus the lookahead (28)."""
        return self.chunk_tokens + self.pre_lookahead_len

    @property
    def source_cache_samples(self) -> int:
        """Samples of source and speech history the HiFT driver keeps (3840)."""
        return self.mel_cache_frames * self.hop_samples

    @property
    def conv_cache_frames(self) -> int:
        """Packed conformer conv cache: 2 (pre-lookahead conv) + 2 x stride (upsampler)."""
        return 2 + 2 * self.up_stride

    @property
    def retention(self) -> HeadTail:
        return HeadTail(self.prompt_frames, self.history_frames)

    @classmethod
    def reduced(cls, **overrides: Any) -> "Token2WavConfig":
        """A configuration for CPU tests: small encoder and vocoder, short stream, 2 solver steps.

        The DiT keeps depth 16 at hidden 512 (the CFM workspace requires it); the prompt is 8
        tokens (16 frames), chunks are 5 + 3 tokens (10 frames) and the history is 20 frames, so
        the attention histories visit 16, 26, 36 frames and the trim fires from the third call.
        """
        base = dict(input_size=64, output_size=64, num_blocks=2, num_up_blocks=2, attention_heads=4,
                    linear_units=128, n_timesteps=2, hift_base_channels=64, prompt_tokens=8, chunk_tokens=5,
                    history_frames=20, workspace_frames=64)
        base.update(overrides)
        return cls(**base)
