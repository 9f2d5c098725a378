"""A small streaming decoder with every state pattern the real Token2Wav decoder has.

- ``encoder``: attention over a concatenated KV cache, old-then-new, trimmed to head + tail;
- ``solver``: a multi-step loop calling ``estimator`` per step; the estimator concatenates
  new-then-old (like the DiT), writes a step-indexed workspace buffer the program owns (with
  more step slots than steps, like the stock 16-slot workspace) and builds a frequency table on
  the host at every step;
- a causal conv with a left-context cache (sliding window).

It is the demo's model and the property tests' model; it is not a stand-in for the real one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cadence_fx.contract import Clock, Contract, HeadTail, Region, SlidingWindow
from cadence_fx.plan import call_classes


@dataclass(frozen=True)
class DemoConfig:
    dim: int = 16
    chunk: int = 4  # new frames per call
    prompt: int = 8  # history extent after setup
    head: int = 8  # retention: keep [:head] and [-tail:]
    tail: int = 6
    steps: int = 3  # solver steps per call
    slots: int = 5  # workspace step slots the model allocates (>= steps)
    capacity: int = 64  # workspace frames the model allocates (>= head + tail + chunk)
    kernel: int = 3
    est_order: str = "new_old"
    enc_order: str = "old_new"
    freq_dtype: torch.dtype | None = None  # host-side dtype of the frequency table (None: x's dtype)


def _cat(order: str, cache: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([cache, new], dim) if order == "old_new" else torch.cat([new, cache], dim)


class Attention(nn.Module):
    def __init__(self, dim: int, order: str) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.order = order

    def forward(self, h: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = _cat(self.order, cache, torch.cat([self.k(h), self.v(h)], -1), -2)
        k, v = kv.chunk(2, -1)
        out = F.scaled_dot_product_attention(self.q(h), k, v)
        return self.o(out), kv


class Encoder(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg.dim, cfg.enc_order)
        self.conv = nn.Conv1d(cfg.dim, cfg.dim, cfg.kernel)
        self.kernel = cfg.kernel

    def forward(self, x: torch.Tensor, kv: torch.Tensor, conv: torch.Tensor):
        # x: (1, n, D); kv: (1, T, 2D); conv: (1, D, kernel-1)
        a, kv = self.attn(x, kv)
        h = x + a
        ci = torch.cat([conv, h.transpose(1, 2)], -1)
        h = h + self.conv(ci).transpose(1, 2)
        return h, kv, ci[..., -(self.kernel - 1):]


class Estimator(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg.dim, cfg.est_order)
        self.t_mlp = nn.Linear(cfg.dim, cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.freq_dtype = cfg.freq_dtype

    def timestep_embedding(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        # built on the host every call and copied to x's device, like the DiT's TimestepEmbedder
        half = dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(start=0, end=half, dtype=self.freq_dtype) / half)
        args = t[:, None] * freqs.to(t)[None]
        return torch.cat([torch.cos(args), torch.sin(args)], -1)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, cache: torch.Tensor):
        h = x + mu + self.t_mlp(self.timestep_embedding(t, x.shape[-1]))[:, None]
        a, kv = self.attn(h, cache)
        return self.out(h + a), kv


class Solver(nn.Module):
    """The multi-step loop; writes each step's cache into its own workspace slot."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.estimator = Estimator(cfg)
        self.steps = cfg.steps
        self.register_buffer("workspace", torch.zeros(cfg.slots, cfg.capacity, 2 * cfg.dim), persistent=False)

    def forward(self, mu: torch.Tensor, noise: torch.Tensor, caches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = noise
        dt = 1.0 / self.steps
        for s in range(self.steps):
            t = torch.full((1,), s * dt, dtype=x.dtype, device=x.device)
            v, kv = self.estimator(x, mu, t, caches[s:s + 1])
            x = x + dt * v
            self.workspace[s:s + 1, : kv.shape[1]] = kv
        return x, self.workspace[:, : kv.shape[1]]


class StreamingDecoder(nn.Module):
    """One streaming step: ``(tokens, enc_kv, est_kv, conv, noise) -> (frames, enc_kv', est_kv', conv')``."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.dim, cfg.dim)
        self.encoder = Encoder(cfg)
        self.solver = Solver(cfg)

    def forward(self, tokens, enc_kv, est_kv, conv, noise):
        cfg = self.cfg
        h, enc_kv, conv = self.encoder(self.embed(tokens), enc_kv, conv)
        x, est_kv = self.solver(h, noise, est_kv)
        return x, trim(enc_kv, 1, cfg.head, cfg.tail), trim(est_kv, 1, cfg.head, cfg.tail), conv

    def initial_state(self, dtype=torch.float32, device="cpu"):
        cfg = self.cfg
        g = torch.Generator().manual_seed(1234)
        enc = torch.randn(1, cfg.prompt, 2 * cfg.dim, generator=g).to(device, dtype)
        est = torch.randn(cfg.slots, cfg.prompt, 2 * cfg.dim, generator=g).to(device, dtype)
        conv = torch.randn(1, cfg.dim, cfg.kernel - 1, generator=g).to(device, dtype)
        return enc, est, conv


def trim(x: torch.Tensor, dim: int, head: int, tail: int) -> torch.Tensor:
    """The stock driver's retention: keep ``[:head]`` and ``[-tail:]`` once longer than ``head + tail``."""
    if x.shape[dim] > head + tail:
        return torch.cat([x.narrow(dim, 0, head), x.narrow(dim, x.shape[dim] - tail, tail)], dim)
    return x


def demo_contract(cfg: DemoConfig, *, wrap: tuple[str, ...] = ("encoder", "solver")) -> Contract:
    """The native-clock contract of :class:`StreamingDecoder`."""
    keep = HeadTail(cfg.head, cfg.tail)
    return Contract(
        clocks=(Clock("frame", cfg.chunk, "frames per call"), Clock("step", cfg.steps, "solver steps")),
        regions=(
            Region("encoder_kv", input="enc_kv", output=1, clock="frame", axis=1, order=cfg.enc_order,
                   retention=keep, initial=cfg.prompt),
            Region("estimator_kv", input="est_kv", output=2, clock="frame", axis=1, order=cfg.est_order,
                   retention=keep, initial=cfg.prompt, live={0: cfg.steps}),
            Region("conv", input="conv", output=3, clock="frame", axis=2, order="old_new",
                   retention=SlidingWindow(cfg.kernel - 1), initial=cfg.kernel - 1),
        ),
        wrap=wrap,
        admit=lambda clocks: clocks["frame"] <= cfg.chunk,
    )


def export_catalog(model: StreamingDecoder, contract: Contract, *, device="cpu", dtype=torch.float32):
    """One static-shape ``torch.export`` program per catalog class of ``contract``."""
    cfg = model.cfg
    eps = []
    for cls in call_classes(contract):
        args = example_args(cfg, cls["encoder_kv"], cls["estimator_kv"], device=device, dtype=dtype)
        eps.append(torch.export.export(model, args))
    return eps


def example_args(cfg: DemoConfig, enc_extent: int, est_extent: int, *, device="cpu", dtype=torch.float32,
                 seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return (r(1, cfg.chunk, cfg.dim), r(1, enc_extent, 2 * cfg.dim), r(cfg.slots, est_extent, 2 * cfg.dim),
            r(1, cfg.dim, cfg.kernel - 1), r(1, cfg.chunk, cfg.dim))
