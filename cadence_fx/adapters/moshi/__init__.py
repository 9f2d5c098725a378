"""The Moshi adapter: Kyutai's full-duplex speech model (``moshi`` 0.2.13 from PyPI) as cadence_fx steps.

What one 80 ms frame of the stock stack does (``moshi/server.py``), and the steps that reproduce it:

1. ``MimiModel.encode`` of the user's 1920 samples in streaming mode -> :class:`MimiEncodeStep`;
2. ``LMGen.step``: the 7B temporal transformer over the delayed token streams (ring KV cache of
   3000 frames), the text token sampled, then the depformer samples the model's 8 audio codes one
   by one -> :class:`LMStep` (sampling included: it draws from the device generator in the order
   the stock step does);
3. ``MimiModel.decode`` of the model's codes -> :class:`MimiDecodeStep`.

Every step is a functional wrapper over the upstream module in streaming mode: its streaming state
(moshi keeps it in ``_streaming_state`` objects) is passed in and returned
(:mod:`~cadence_fx.adapters.moshi.state`), so ``torch.export`` sees it and a contract can own it.
The modules, by concern:

- :mod:`~cadence_fx.adapters.moshi.upstream`: importing the installed ``moshi`` without what the
  step does not need (:func:`load_moshi`);
- :mod:`~cadence_fx.adapters.moshi.config`: :class:`MoshiConfig` (released sizes, reduced sizes);
- :mod:`~cadence_fx.adapters.moshi.build`: the stock modules with seeded random weights;
- :mod:`~cadence_fx.adapters.moshi.state`: where each state tensor lives upstream;
- :mod:`~cadence_fx.adapters.moshi.steps`: the exported steps;
- :mod:`~cadence_fx.adapters.moshi.contracts`: their contracts (rings, counters, conv contexts);
- :mod:`~cadence_fx.adapters.moshi.driver`: the full-duplex stream, stock and through the steps.
"""

from cadence_fx.adapters.moshi.build import build_lm, build_lm_gen, build_mimi
from cadence_fx.adapters.moshi.config import MoshiConfig
from cadence_fx.adapters.moshi.contracts import FRAME, moshi_contract, slot_region
from cadence_fx.adapters.moshi.driver import (Frame, StreamSteps, build_steps, install_state, reset_host_counters,
                                              shared_replay, step_frame, step_stream, stock_stream, user_audio)
from cadence_fx.adapters.moshi.state import StateSlot, UnsupportedState, read_state, state_slots, write_state
from cadence_fx.adapters.moshi.steps import LMStep, MimiDecodeStep, MimiEncodeStep, MoshiStep, upstream_eager
from cadence_fx.adapters.moshi.upstream import MOSHI_VERSION, UpstreamNotFound, find_moshi_root, load_moshi

__all__ = [
    "build_lm", "build_lm_gen", "build_mimi", "build_steps", "find_moshi_root", "Frame", "FRAME", "install_state",
    "LMStep", "load_moshi", "MimiDecodeStep", "MimiEncodeStep", "MOSHI_VERSION", "moshi_contract", "MoshiConfig",
    "MoshiStep", "read_state", "reset_host_counters", "shared_replay", "slot_region", "state_slots", "StateSlot", "step_frame", "step_stream",
    "stock_stream", "StreamSteps", "UnsupportedState", "UpstreamNotFound", "upstream_eager", "user_audio",
    "write_state",
]
