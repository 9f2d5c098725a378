"""torchaudio 2.9.1's pure-Python model files (``Emformer``, the RNN-T), imported without torchaudio.

What is installed: ``pip install --no-deps --target .upstream/torchaudio-2.9.1 torchaudio==2.9.1``
(``scripts/test.sh``). The folder is ``$CADENCE_FX_UPSTREAM/torchaudio-2.9.1`` (a relative
``$CADENCE_FX_UPSTREAM`` is taken from the repository root; unset, it is ``.upstream``).

Why not ``import torchaudio``: the wheel is built against torch 2.9, and ``torchaudio/__init__.py``
first loads its C extension (``from . import _extension``), which raises ``OSError`` loading
``libtorchaudio.so`` beside torch 2.13 (undefined torch symbols). ``torchaudio/models/__init__.py``
in turn imports every model (HDemucs, Conformer, wav2vec2, Tacotron2, the squim models, the RNN-T
beam search...), some of which reach ``torchaudio.functional`` and so the extension again.

What the corpus needs imports only ``torch`` and the standard library:

- ``torchaudio/models/emformer.py``: ``math``, ``typing``, ``torch``;
- ``torchaudio/models/rnnt.py``: ``abc``, ``typing``, ``torch`` and, with an *absolute* import,
  ``from torchaudio.models import Emformer`` (its ``_EmformerEncoder`` builds one).

So :func:`load` runs neither ``__init__``. For the duration of the load only, it registers in
``sys.modules`` a bare ``torchaudio`` package and a bare ``torchaudio.models`` package (plain module
objects whose ``__path__`` is the installed folder, so the real files are found where they are, and
whose ``__init__`` is never executed), executes ``emformer.py`` from its file as
``torchaudio.models.emformer`` (``importlib.util.spec_from_file_location``), sets
``torchaudio.models.Emformer`` from it (what the package ``__init__`` would have exported, and all
that ``rnnt.py`` asks of it), then executes ``rnnt.py`` as ``torchaudio.models.rnnt``. Afterwards the
four entries are taken out of ``sys.modules`` again (whatever was there before is put back): a later
``import torchaudio`` elsewhere in the process (transformers probes for it) must not find a stub
that has no ``functional``, ``transforms``... The module objects stay alive in this module's cache
and the classes keep working (their functions hold their globals, not ``sys.modules``); their
``__module__`` is still ``torchaudio.models.emformer`` / ``.rnnt``, so ``nn_module_stack`` paths and
error messages name them as upstream does. Nothing of torchaudio is copied into this repository.

The installed version is read off the ``torchaudio-*.dist-info`` folder and must be 2.9.1.
Missing files raise :class:`FileNotFoundError` saying to run ``bash scripts/test.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
import types
from pathlib import Path

VERSION = "2.9.1"
FOLDER = f"torchaudio-{VERSION}"
_REPO = Path(__file__).resolve().parents[2]
_lock = threading.Lock()
_loaded: dict[str, types.SimpleNamespace] = {}


def root() -> Path:
    """The folder holding ``torchaudio/`` (``$CADENCE_FX_UPSTREAM/torchaudio-2.9.1``)."""
    up = Path(os.environ.get("CADENCE_FX_UPSTREAM") or ".upstream")
    return (up if up.is_absolute() else _REPO / up) / FOLDER


def load() -> types.SimpleNamespace:
    """``SimpleNamespace(version, root, emformer, rnnt)``: the two upstream modules, loaded once."""
    base = root()
    models = base / "torchaudio" / "models"
    missing = [p for p in (models / "emformer.py", models / "rnnt.py") if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"torchaudio {VERSION}'s model files are not installed ({', '.join(map(str, missing))} missing): "
            f"run `bash scripts/test.sh` (it runs pip install --no-deps --target {base} torchaudio=={VERSION})")
    found = _version(base)
    if found != VERSION:
        raise RuntimeError(f"torchaudio {found} at {base}; the corpus is written against torchaudio {VERSION}")
    with _lock:
        if str(base) in _loaded:
            return _loaded[str(base)]
        names = ("torchaudio", "torchaudio.models", "torchaudio.models.emformer", "torchaudio.models.rnnt")
        before = {n: sys.modules.get(n) for n in names}
        try:
            top = _bare_package("torchaudio", base / "torchaudio")
            pkg = _bare_package("torchaudio.models", models)
            top.models = pkg
            sys.modules["torchaudio"], sys.modules["torchaudio.models"] = top, pkg
            emformer = _exec_file("torchaudio.models.emformer", models / "emformer.py")
            pkg.emformer, pkg.Emformer = emformer, emformer.Emformer  # `from torchaudio.models import Emformer`
            rnnt = _exec_file("torchaudio.models.rnnt", models / "rnnt.py")
        finally:
            for n, m in before.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
        ns = types.SimpleNamespace(version=found, root=base, emformer=emformer, rnnt=rnnt)
        _loaded[str(base)] = ns
        return ns


def _version(base: Path) -> str:
    for info in sorted(base.glob("torchaudio-*.dist-info")):
        m = re.match(r"torchaudio-([0-9][^-]*)\.dist-info$", info.name)
        if m:
            return m.group(1)
    return "unknown"


def _bare_package(name: str, folder: Path) -> types.ModuleType:
    pkg = types.ModuleType(name, f"{name} from {folder} (its __init__ not run: tests/corpus/_torchaudio.py)")
    pkg.__path__ = [str(folder)]
    pkg.__package__ = name
    pkg.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    pkg.__spec__.submodule_search_locations = [str(folder)]
    return pkg


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # while it executes (dataclasses, typing and pickling look modules up by name)
    spec.loader.exec_module(mod)
    return mod
