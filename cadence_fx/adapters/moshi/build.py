"""The stock upstream modules at a :class:`MoshiConfig`, with seeded random weights.

The vendor's own builders (``get_moshi_lm`` and ``get_mimi`` with no checkpoint) make the modules;
the released weights are neither needed nor available. ``get_moshi_lm`` builds the LM directly on
the target device in the target dtype (7B in bf16 on the GPU: about 15 GiB, initialised there, never
on the host in fp32). Mimi's codebooks start as zeros upstream (k-means fills them in training),
which would decode every code to the same vector; :func:`build_mimi` gives them seeded random
centroids, so codes carry information through the decoder.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from cadence_fx.adapters.moshi.config import MoshiConfig

__all__ = ["build_lm", "build_lm_gen", "build_mimi"]


def build_lm(up: types.SimpleNamespace, cfg: MoshiConfig, device: torch.device | str = "cpu") -> nn.Module:
    """``LMModel`` through ``get_moshi_lm(None, ...)`` on ``device`` in ``cfg.dtype``, seeded, in eval mode."""
    _seed(cfg.seed, device)
    return up.loaders.get_moshi_lm(None, lm_kwargs=cfg.lm_kwargs(up), device=device, dtype=cfg.dtype).eval()


def build_lm_gen(up: types.SimpleNamespace, cfg: MoshiConfig, lm: nn.Module) -> nn.Module:
    """``LMGen`` over ``lm`` with the configuration's sampling (the server's defaults for the released model)."""
    return up.lm.LMGen(lm, use_sampling=cfg.use_sampling, temp=cfg.temp, temp_text=cfg.temp_text, top_k=cfg.top_k,
                       top_k_text=cfg.top_k_text)


def build_mimi(up: types.SimpleNamespace, cfg: MoshiConfig, device: torch.device | str = "cpu") -> nn.Module:
    """``MimiModel`` through ``get_mimi(None, ...)`` (fp32, eval, ``cfg.num_codebooks`` codebooks) with
    seeded random codebook centroids; the centroid table the quantizer caches on first use is built
    here, so no call (and no export) registers a buffer."""
    _seed(cfg.seed + 1, device)
    mimi = up.loaders.get_mimi(None, mimi_config=cfg.mimi_config(up), device=device,
                               num_codebooks=cfg.num_codebooks)
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + 2)
    with torch.no_grad():
        for mod in mimi.modules():
            if hasattr(mod, "embedding_sum") and hasattr(mod, "cluster_usage"):
                mod.embedding_sum.copy_(torch.randn(mod.embedding_sum.shape, generator=g).to(device))
                mod.cluster_usage.fill_(1.0)
                mod._buffers.pop("_embedding", None)
                mod.register_buffer("_embedding", None, persistent=False)
                _ = mod.embedding  # caches the centroid table as a buffer now, not during a call
    return mimi.eval()


def _seed(seed: int, device: torch.device | str) -> None:
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
