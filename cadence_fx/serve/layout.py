"""Which of a step's inputs and outputs are the conversation's state, and which are the chunk's.

A served conversation keeps its state where it is computed: the client sends only a chunk's own
inputs (tokens, noise) and gets only the chunk's own outputs (frames, PCM), never the KV caches.
:class:`StepLayout` reads that split off the loaded program's contract (each region names its input
and its output), so a worker needs nothing but the artifact: it assembles a call from the chunk's
inputs and the session's last returned state, and keeps the state outputs for the next call.

It also makes stand-in inputs from the catalog's first class (zeros of each input's exact shape and
dtype) for warm-up and calibration, where the config gives no example: capture needs shapes, not
values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from cadence_fx.program import OptimizedProgram

__all__ = ["StepLayout"]


@dataclass(frozen=True)
class StepLayout:
    """The split of one program's calls between chunk and state.

    ``names``: every input, in calling order. ``regions``: region name -> input position.
    ``region_outputs``: region name -> output position (dropped from what the client gets).
    ``chunk_names``: the inputs a client sends, in order.
    """

    names: tuple[str, ...]
    regions: Mapping[str, int]
    region_outputs: Mapping[str, int]
    chunk_names: tuple[str, ...]

    @classmethod
    def of(cls, prog: OptimizedProgram) -> "StepLayout":
        if prog.buffer_regions:
            raise ValueError("serving needs every region to be an input and an output of the step; this "
                             "program keeps regions in module buffers (cf.save refuses those anyway)")
        names = tuple(prog.input_names)
        regions = {r.name: prog.input_index(r.name) for r in prog.contract.regions}
        outputs = {r.name: int(r.output) for r in prog.contract.regions if r.output is not None}
        chunk = tuple(n for i, n in enumerate(names) if i not in set(regions.values()))
        return cls(names, regions, outputs, chunk)

    # ------------------------------------------------------------------ calls
    def chunk_inputs(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        """A chunk's inputs in order: a sequence as given, or a mapping by input name."""
        if isinstance(inputs, Mapping):
            missing = [n for n in self.chunk_names if n not in inputs]
            extra = sorted(set(inputs) - set(self.chunk_names))
            if missing or extra:
                raise TypeError(f"chunk inputs by name: missing {missing}, unexpected {extra}; the chunk's "
                                f"inputs are {list(self.chunk_names)} (the state inputs stay on the worker)")
            return [inputs[n] for n in self.chunk_names]
        items = list(inputs)
        if len(items) != len(self.chunk_names):
            raise TypeError(f"{len(items)} chunk inputs given; a chunk takes {len(self.chunk_names)}: "
                            f"{list(self.chunk_names)} (the state inputs stay on the worker)")
        return items

    def call_args(self, chunk: Sequence[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
        """The program's positional inputs: the chunk's in their places, each region's state in its own."""
        out: list[Any] = [None] * len(self.names)
        by_pos = {i: name for name, i in self.regions.items()}
        it = iter(chunk)
        for i in range(len(self.names)):
            out[i] = state[by_pos[i]] if i in by_pos else next(it)
        return out

    def split_outputs(self, out: Any) -> tuple[list[Any], dict[str, torch.Tensor]]:
        """(the outputs a client gets: every output but the region states, in order; each region's
        returned state, by name: what the next call is fed)."""
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        state_at = set(self.region_outputs.values())
        return ([o for j, o in enumerate(outs) if j not in state_at],
                {name: outs[j] for name, j in self.region_outputs.items()})

    def prompt(self, given: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None,
               region_order: Sequence[str], zeros: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A conversation's initial state by region name: a mapping, a sequence in contract order, or
        ``None`` (zeros of the first class's extents: a model whose conversations start empty)."""
        if given is None:
            return {n: t.clone() for n, t in zeros.items()}
        if isinstance(given, Mapping):
            if set(given) != set(region_order):
                raise TypeError(f"initial state for regions {sorted(given)}; the program's regions are "
                                f"{list(region_order)}")
            return dict(given)
        items = list(given)
        if len(items) != len(region_order):
            raise TypeError(f"{len(items)} initial state tensors given; the program has {len(region_order)} "
                            f"regions: {list(region_order)} (in contract order)")
        return dict(zip(region_order, items))

    # ------------------------------------------------------------------ stand-ins
    def zeros(self, prog: OptimizedProgram, device: torch.device | str) -> tuple[list[Any], dict[str, torch.Tensor]]:
        """Zeros shaped like the catalog's first class: (the chunk's inputs, the state by region)."""
        key = next(iter(prog.catalog))
        values: list[Any] = []
        for k in key:
            if k[0] == "T":
                values.append(torch.zeros(k[1], dtype=k[2], device=device))
            else:
                values.append(k[2] if len(k) > 2 else 0)
        by_pos = {i: name for name, i in self.regions.items()}
        chunk = [v for i, v in enumerate(values) if i not in by_pos]
        return chunk, {name: values[i] for i, name in by_pos.items()}
