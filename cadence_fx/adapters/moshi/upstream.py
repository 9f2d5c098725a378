"""Loading the upstream ``moshi`` package (PyPI ``moshi==0.2.13``) for the streaming step only.

The wheel declares dependencies the step never touches: audio I/O (``sounddevice``, ``sphn``), the
web client (``aiohttp``), 8-bit kernels (``bitsandbytes``), and ``torch<2.10`` (the step runs on
torch 2.11 and 2.13). So it is installed with ``pip install --no-deps --target
.upstream/moshi-0.2.13`` (``scripts/test.sh``) or, on a machine without a package index, from a
carried wheel (``scripts/gpu.sh``). What the step needs of it imports only ``torch``, ``einops`` and
``numpy``; ``moshi.models.loaders`` (where the released configurations and the vendor's own model
builders live) also imports ``huggingface_hub``, ``safetensors`` and ``sentencepiece`` at module level
for checkpoint download and the text tokenizer, neither of which a random-weight step uses. Where
those are not installed, :func:`load_moshi` satisfies the imports with inert placeholders whose every
entry point raises, for the duration of the import only.

The package ``__init__`` files of ``moshi`` and ``moshi.models`` import every submodule (TTS,
conditioners, the checkpoint loaders); like :mod:`cadence_fx.adapters.stepaudio2` for ``stepaudio2``, a
bare package module is registered instead and only the submodules the step needs are imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
import types
from pathlib import Path

from cadence_fx.adapters.stepaudio2 import placeholder_imports

__all__ = ["MOSHI_VERSION", "UpstreamNotFound", "find_moshi_root", "load_moshi"]

#: The release this adapter reproduces (the one measured in the issue).
MOSHI_VERSION = "0.2.13"
PACKAGE = "moshi"
FOLDER = f"moshi-{MOSHI_VERSION}"

# Submodules the steps use, by the attribute they get on the returned namespace.
_SUBMODULES = {
    "compile": "moshi.utils.compile",
    "sampling": "moshi.utils.sampling",
    "streaming": "moshi.modules.streaming",
    "transformer": "moshi.modules.transformer",
    "conv": "moshi.modules.conv",
    "lm": "moshi.models.lm",
    "compression": "moshi.models.compression",
    "loaders": "moshi.models.loaders",
}
# Packages whose ``__init__`` is skipped (they import the whole library, TTS and checkpoint code included).
_BARE_PACKAGES = ("moshi", "moshi.models")

_lock = threading.Lock()
_loaded: dict[str, types.SimpleNamespace] = {}


class UpstreamNotFound(FileNotFoundError):
    """No installed ``moshi`` package where one was looked for."""


def find_moshi_root(root: str | Path | None = None) -> Path:
    """The folder that holds the ``moshi`` package to load.

    ``root`` if given; else ``$CADENCE_FX_UPSTREAM/moshi-0.2.13`` (what ``scripts/test.sh`` installs)
    when it exists; else the folder of an importable ``moshi`` (a wheel installed into the
    environment, as ``scripts/gpu.sh`` does on the GPU machine). Raises :class:`UpstreamNotFound`.
    """
    if root is not None:
        candidates = [Path(root)]
    else:
        candidates = []
        up = os.environ.get("CADENCE_FX_UPSTREAM")
        if up:
            candidates.append(Path(up) / FOLDER)
        candidates.append(Path(__file__).resolve().parents[3] / ".upstream" / FOLDER)
    for c in candidates:
        if (c / PACKAGE / "__init__.py").is_file():
            return c.resolve()
    if root is None:
        if PACKAGE in sys.modules:  # already imported (by us or by the user): that one
            return Path(_root_of(sys.modules[PACKAGE]))
        spec = importlib.util.find_spec(PACKAGE)
        if spec is not None and spec.origin:
            return Path(spec.origin).resolve().parents[1]
    raise UpstreamNotFound(
        f"no installed {PACKAGE!r} package (looked in {[str(c) for c in candidates]}"
        f"{'' if root is not None else ' and on sys.path'}); install it with "
        f"pip install --no-deps --target .upstream/{FOLDER} moshi=={MOSHI_VERSION}")


def detect_version(root: Path) -> str:
    """The moshi version installed in ``root``: its ``*.dist-info`` folder, else ``__version__`` in the source."""
    for info in sorted(root.glob("moshi-*.dist-info")):
        m = re.match(r"moshi-([0-9][^-]*)\.dist-info$", info.name)
        if m:
            return m.group(1)
    m = re.search(r'__version__\s*=\s*"([^"]+)"', (root / PACKAGE / "__init__.py").read_text())
    return m.group(1) if m else "unknown"


def load_moshi(root: str | Path | None = None, *, version: str | None = MOSHI_VERSION) -> types.SimpleNamespace:
    """Import the submodules of ``moshi`` the streaming steps need.

    Args:
        root: a folder containing ``moshi/`` (see :func:`find_moshi_root` for the default).
        version: the release required (``None``: any). A different one raises ``RuntimeError``,
            since the adapter reads upstream internals (streaming state fields) of that release.

    Returns:
        A namespace with ``version``, ``root`` and the modules ``compile``, ``sampling``,
        ``streaming``, ``transformer``, ``conv``, ``lm``, ``compression`` and ``loaders``.

    Raises:
        UpstreamNotFound: no ``moshi`` package found.
    """
    root = find_moshi_root(root)
    found = detect_version(root)
    if version is not None and found != version:
        raise RuntimeError(f"moshi {found} at {root}; the adapter is written against moshi {version} "
                           f"(pip install --no-deps --target .upstream/{FOLDER} moshi=={version})")
    key = str(root)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        present = sys.modules.get(PACKAGE)
        if present is not None and _root_of(present) != key:
            raise RuntimeError(f"another moshi is already imported from {_root_of(present)}; cannot load {root}")
        added: list[str] = []
        try:
            for name in _BARE_PACKAGES:
                if name not in sys.modules:
                    sys.modules[name] = _bare_package(name, root)
                    added.append(name)
            with placeholder_imports(_placeholder_modules()):
                mods = {attr: importlib.import_module(path) for attr, path in _SUBMODULES.items()}
        except BaseException:
            for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
                if name in added or not present:
                    sys.modules.pop(name, None)
            raise
        ns = types.SimpleNamespace(version=found, root=root, **mods)
        _loaded[key] = ns
        return ns


def _root_of(mod: types.ModuleType) -> str:
    marked = getattr(mod, "__cadence_fx_root__", None)
    if marked:
        return marked
    path = list(getattr(mod, "__path__", []))
    return str(Path(path[0]).resolve().parent) if path else ""


def _bare_package(name: str, root: Path) -> types.ModuleType:
    pkg = types.ModuleType(name, f"{name} from {root} (package __init__ not run by cadence_fx)")
    pkg.__path__ = [str(root.joinpath(*name.split(".")))]
    pkg.__file__ = None
    pkg.__package__ = name
    pkg.__cadence_fx_root__ = str(root)
    pkg.__version__ = detect_version(root)
    return pkg


def _unavailable(what: str):
    def _raise(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"{what} is not installed: cadence_fx only satisfied its import for moshi.models.loaders "
                           "(the streaming steps load no checkpoint and no text tokenizer)")
    return _raise


def _placeholder_modules() -> dict[str, types.ModuleType]:
    """Inert stand-ins for what ``moshi/models/loaders.py`` imports at module level."""
    hub = types.ModuleType("huggingface_hub", "cadence_fx placeholder")
    hub.hf_hub_download = _unavailable("huggingface_hub")
    errors = types.ModuleType("huggingface_hub.errors", "cadence_fx placeholder")
    errors.EntryNotFoundError = type("EntryNotFoundError", (Exception,), {})
    hub.errors = errors
    st = types.ModuleType("safetensors", "cadence_fx placeholder")
    st_torch = types.ModuleType("safetensors.torch", "cadence_fx placeholder")
    st_torch.load_file = _unavailable("safetensors")
    st.torch = st_torch
    spm = types.ModuleType("sentencepiece", "cadence_fx placeholder")
    # used in an annotation at class creation, constructed only for the text tokenizer
    spm.SentencePieceProcessor = type("SentencePieceProcessor", (), {"__init__": _unavailable("sentencepiece")})
    return {"huggingface_hub": hub, "huggingface_hub.errors": errors, "safetensors": st,
            "safetensors.torch": st_torch, "sentencepiece": spm}
