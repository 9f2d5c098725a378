"""Proxies that make the upstream ``forward_chunk`` calls visible to ``torch.export``.

A module entered through a method other than ``__call__`` (upstream calls
``self.encoder.forward_chunk(...)``, ``self.decoder.forward_chunk(...)``,
``self.estimator.forward_chunk(...)``) is not recorded in ``nn_module_stack``, so cadence_fx could
not find its boundary. :func:`routed` installs small proxies whose ``forward_chunk`` goes through
``__call__``, for the duration of an export, and puts the user's modules back afterwards (their
``state_dict`` keys never change). The proxies must be in the module tree when ``torch.export``
starts: it records calls on the attribute path it reached a module by, so swapping a proxy in
from inside ``forward`` is not seen.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from cadence_fx.adapters.token2wav.config import Granularity
from cadence_fx.adapters.stepaudio2 import unwrap_compiled

__all__ = ["CFMChunk", "EncoderChunk", "EstimatorChunk", "VocoderCall", "routed"]


class _Route(nn.Module):
    """Base of the proxies: ``forward_chunk`` enters through ``__call__`` so export records the call."""

    def __init__(self, upstream: nn.Module) -> None:
        super().__init__()
        self.upstream = upstream

    def forward_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)


class EncoderChunk(_Route):
    """``UpsampleConformerEncoderV2.forward_chunk`` as a module call.

    1.0.7 decorates ``forward_chunk`` with ``torch.compile(dynamic=True, backend="eager")``;
    this calls the function the decorator wraps (what 0.1.2 runs undecorated), so export traces
    the upstream code itself instead of a Dynamo frame.
    """

    def forward(self, xs: torch.Tensor, last_chunk: bool = False, cnn_cache: torch.Tensor | None = None,
                att_cache: torch.Tensor | None = None):
        fn = unwrap_compiled(type(self.upstream).forward_chunk)
        return fn(self.upstream, xs, last_chunk, cnn_cache, att_cache)


class CFMChunk(_Route):
    """``CausalConditionalCFM.forward_chunk`` (the whole Euler loop) as a module call: the chunk clock.

    Calls the function under ``@torch.inference_mode()`` directly: export traces plain tensors.
    """

    def forward(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int = 10,
                temperature: float = 1.0, cnn_cache: torch.Tensor | None = None,
                att_cache: torch.Tensor | None = None):
        fn = unwrap_compiled(type(self.upstream).forward_chunk)
        return fn(self.upstream, mu, spks, cond, n_timesteps, temperature, cnn_cache, att_cache)


class EstimatorChunk(_Route):
    """``DiT.forward_chunk`` as a module call: installed as ``cfm.estimator``, each solver step is
    its own invocation (the step clock)."""

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                cnn_cache: torch.Tensor | None = None, att_cache: torch.Tensor | None = None):
        return self.upstream.forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache)


class VocoderCall(_Route):
    """``HiFTGenerator.forward(mel, cache_source)`` (the function under ``@torch.inference_mode()``)."""

    def forward(self, speech_feat: torch.Tensor, cache_source: torch.Tensor):
        fn = unwrap_compiled(type(self.upstream).forward)
        return fn(self.upstream, speech_feat, cache_source)


@contextlib.contextmanager
def routed(flow: nn.Module, *, granularity: Granularity = "chunk") -> Iterator[None]:
    """Install the proxies on ``flow`` (encoder, decoder and, for ``"step"``, the estimator); restore on exit.

    The exported program keeps the proxies' paths (:data:`ENCODER_PATH`, :data:`CFM_PATH`,
    :data:`ESTIMATOR_PATH`); the user's modules are unchanged after the block. A program exported
    with ``"step"`` routing carries both the CFM-loop and the per-step boundaries, so it serves
    both granularities: the contract's ``wrap`` list picks one.
    """
    cfm = flow.decoder
    saved = [(flow, "encoder", flow.encoder), (flow, "decoder", cfm), (cfm, "estimator", cfm.estimator)]
    if isinstance(flow.encoder, _Route) or isinstance(cfm, _Route):
        raise RuntimeError("routed(): the flow already has cadence_fx proxies installed")
    try:
        if granularity == "step":
            cfm._modules["estimator"] = EstimatorChunk(cfm.estimator)
        elif granularity != "chunk":
            raise ValueError(f"granularity must be 'chunk' or 'step', got {granularity!r}")
        flow._modules["encoder"] = EncoderChunk(flow.encoder)
        flow._modules["decoder"] = CFMChunk(cfm)
        yield
    finally:
        for owner, name, mod in saved:
            owner._modules[name] = mod


def upstream_module(m: nn.Module) -> nn.Module:
    """The user's module behind a proxy (or ``m`` itself)."""
    return m.upstream if isinstance(m, _Route) else m
