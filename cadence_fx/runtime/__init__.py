"""What an optimized program keeps across calls, apart from the rewriting that built it.

- :mod:`~cadence_fx.runtime.catalog`: one rewritten program per exact signature and the dispatch.
- :mod:`~cadence_fx.runtime.state`: the region buffers and workspaces, and how state inputs reach them.
- :mod:`~cadence_fx.runtime.runners`: the replay engines installed on annotated partitions, and warm-up.
- :mod:`~cadence_fx.runtime.owners`: which program, lane or session owns a state buffer (process-wide).
- :mod:`~cadence_fx.runtime.transaction`: a call that raises leaves the state as it was.
- :mod:`~cadence_fx.runtime.warmup`: every class captured before traffic, all state left as found.
- :mod:`~cadence_fx.runtime.census`: a program's engines, counters, bytes by kind and undeclared state.
"""

from cadence_fx.runtime.catalog import Catalog, CatalogMiss, reference
from cadence_fx.runtime.runners import CaptureSession, ReplayRunner, RunnerSet, install_runners
from cadence_fx.runtime.state import StaleState, StateStore

__all__ = ["CaptureSession", "Catalog", "CatalogMiss", "ReplayRunner", "RunnerSet", "StaleState", "StateStore",
           "install_runners", "reference"]
