"""Adapters: real streaming models wired to cadence_fx (steps to export, contracts, stock drivers).

- :mod:`cadence_fx.adapters.upstream`: loads the ``stepaudio2`` decoder modules from a
  ``pip install --no-deps --target`` folder of ``minicpmo`` 0.1.2 or ``minicpmo-utils`` 1.0.7
  without running the package ``__init__``.
- :mod:`cadence_fx.adapters.token2wav`: the Step-Audio2 / MiniCPM-o Token2Wav streaming decoder
  (upsampling conformer encoder, 10-step CFM over the DiT estimator, HiFT vocoder): its stock
  per-chunk step, the DiT-only and encoder-only steps, their contracts, per-class export and the
  stock eager driver for comparisons.
- :mod:`cadence_fx.adapters.bounded_vocoder`: the 1.0.7 causal ``BoundedVocoder``: its host-driven
  stream stays stock, its stateless ``decode`` runs as an optimized, replayed catalog.

Adapters import upstream code; they never copy it.
"""
