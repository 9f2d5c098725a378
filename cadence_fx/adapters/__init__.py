"""Adapters: real streaming models wired to cadence_fx (steps to export, contracts, stock drivers).

- :mod:`cadence_fx.adapters.streaming`: model-agnostic: the :class:`StreamingStep` convention
  (inputs, carried state, an export hook), per-catalog-class export, stream driving and the
  reference over the unmodified exported programs.
- :mod:`cadence_fx.adapters.stepaudio2`: loads the ``stepaudio2`` decoder modules from a
  ``pip install --no-deps --target`` folder of ``minicpmo`` 0.1.2 or ``minicpmo-utils`` 1.0.7
  without running the package ``__init__``.
- :mod:`cadence_fx.adapters.token2wav`: the Step-Audio2 / MiniCPM-o Token2Wav streaming decoder
  (upsampling conformer encoder, 10-step CFM over the DiT estimator, HiFT vocoder), a package split
  by concern: configuration, building the stock modules, the routing proxies, the stock driver
  logic, the exported steps, their contracts and the plan target.
- :mod:`cadence_fx.adapters.bounded_vocoder`: the 1.0.7 causal ``BoundedVocoder``: its host-driven
  stream stays stock, its stateless ``decode`` runs as an optimized, replayed catalog.
- :mod:`cadence_fx.adapters.code2wav`: Qwen3-Omni's Code2Wav (transformers ``Qwen3OmniMoeCode2Wav``):
  the released config with random weights, ``chunked_decode``'s step ``(ctx_codes, new_codes) ->
  (wav, next_ctx)`` with the context as one sliding-window region that starts empty, and ``bind``.

Adapters import upstream code; they never copy it.
"""
