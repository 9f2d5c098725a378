"""Loading the upstream ``stepaudio2`` decoder modules without running the package ``__init__``.

Two PyPI releases ship the same package name ``stepaudio2`` (``minicpmo`` 0.1.2 and
``minicpmo-utils`` 1.0.7), so each is installed into its own folder with
``pip install --no-deps --target <dir>``. Their ``stepaudio2/__init__.py`` imports the ASR
tokenizer, onnxruntime and torchaudio, none of which the decoder needs. :func:`load_stepaudio2`
registers a bare package module whose ``__path__`` points at the installed folder and imports
only the decoder submodules from it.

Only one ``stepaudio2`` can live in ``sys.modules`` at a time: loading a different root purges
every ``stepaudio2*`` entry first. Objects built from an earlier load keep working (their
modules keep their own globals); only the *names* in ``sys.modules`` move to the new root.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import re
import sys
import threading
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping


PACKAGE = "stepaudio2"

# Submodules the decoder needs, by the attribute name they get on the returned namespace.
_SUBMODULES = {
    "flow": "stepaudio2.cosyvoice2.flow.flow",
    "flow_matching": "stepaudio2.cosyvoice2.flow.flow_matching",
    "decoder_dit": "stepaudio2.cosyvoice2.flow.decoder_dit",
    "upsample_encoder_v2": "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
    "hifigan": "stepaudio2.flashcosyvoice.modules.hifigan",
}
# Only in minicpmo-utils 1.0.7.
_OPTIONAL = {
    "causal_generator": "stepaudio2.causal_vocoder.generator",
    "causal_f0_predictor": "stepaudio2.causal_vocoder.f0_predictor",
    "bounded_vocoder": "stepaudio2.causal_vocoder.bounded_vocoder",
}
# Imported at module level by an upstream file but never used by the decoder
# (``flow_matching.py`` does ``import onnxruntime``): satisfied by an inert placeholder
# during the import when the real package is absent, removed again afterwards.
_UNUSED_IMPORTS = ("onnxruntime",)

_lock = threading.Lock()
_loaded: dict[str, types.SimpleNamespace] = {}


class UpstreamNotFound(FileNotFoundError):
    """The folder does not hold an installed ``stepaudio2`` package."""


def detect_version(root: str | Path) -> str:
    """The distribution version installed in ``root``: from its ``*.dist-info`` folder, else by content."""
    root = Path(root)
    for info in sorted(root.glob("*.dist-info")):
        m = re.match(r"(minicpmo(?:[_-]utils)?)-([0-9][^-]*)\.dist-info$", info.name)
        if m:
            return m.group(2)
    # No metadata (e.g. a plain copy): 1.0.7 is the release that added the causal vocoder.
    return "1.0.7" if (root / PACKAGE / "causal_vocoder").is_dir() else "0.1.2"


def load_stepaudio2(root: str | Path) -> types.SimpleNamespace:
    """Import the decoder modules of the ``stepaudio2`` installed under ``root``.

    Args:
        root: a folder containing ``stepaudio2/`` (a ``pip install --no-deps --target`` folder).

    Returns:
        A namespace with ``version`` (e.g. ``"0.1.2"``), ``root``, the modules (``flow``,
        ``flow_matching``, ``decoder_dit``, ``upsample_encoder_v2``, ``hifigan`` and, for 1.0.7,
        ``causal_generator``, ``causal_f0_predictor`` and ``bounded_vocoder``; ``None`` where
        absent) and the classes ``CausalMaskedDiffWithXvec``, ``CausalConditionalCFM``, ``DiT``,
        ``UpsampleConformerEncoderV2``, ``HiFTGenerator`` (and ``BoundedVocoder`` or ``None``).

    Raises:
        UpstreamNotFound: ``root`` has no ``stepaudio2`` package.
    """
    root = Path(root).resolve()
    pkg_dir = root / PACKAGE
    if not (pkg_dir / "__init__.py").is_file():
        raise UpstreamNotFound(f"no installed {PACKAGE!r} package under {root} "
                               f"(expected {pkg_dir}/__init__.py; install with pip install --no-deps --target)")
    key = str(root)
    with _lock:
        if key in _loaded:
            # Already imported: the modules keep their own globals, so the namespace stays valid
            # even after another root took over the ``stepaudio2`` names in sys.modules.
            return _loaded[key]
        _purge()
        pkg = types.ModuleType(PACKAGE, f"stepaudio2 from {root} (package __init__ not run)")
        pkg.__path__ = [str(pkg_dir)]
        pkg.__file__ = None
        pkg.__package__ = PACKAGE
        pkg.__cadence_fx_root__ = key
        sys.modules[PACKAGE] = pkg
        try:
            with _dynamo_config_preserved(), placeholder_imports({name: _inert(name) for name in _UNUSED_IMPORTS}):
                mods = {name: importlib.import_module(path) for name, path in _SUBMODULES.items()}
                for name, path in _OPTIONAL.items():
                    mods[name] = importlib.import_module(path) if _exists(root, path) else None
        except BaseException:
            _purge()
            raise
        ns = types.SimpleNamespace(
            version=detect_version(root),
            root=root,
            **mods,
            CausalMaskedDiffWithXvec=mods["flow"].CausalMaskedDiffWithXvec,
            CausalConditionalCFM=mods["flow_matching"].CausalConditionalCFM,
            DiT=mods["decoder_dit"].DiT,
            UpsampleConformerEncoderV2=mods["upsample_encoder_v2"].UpsampleConformerEncoderV2,
            HiFTGenerator=mods["hifigan"].HiFTGenerator,
            BoundedVocoder=mods["bounded_vocoder"].BoundedVocoder if mods["bounded_vocoder"] else None,
        )
        _loaded[key] = ns
        return ns


def unwrap_compiled(fn: object) -> object:
    """The plain function behind ``@torch.compile`` (1.0.7 compiles the encoder's ``forward_chunk``).

    ``torch.compile`` keeps the original callable (``functools.wraps`` sets ``__wrapped__``);
    calling it traces the upstream code itself, exactly what the undecorated 0.1.2 release runs.
    """
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    return orig if orig is not None else inspect.unwrap(fn)


def _exists(root: Path, dotted: str) -> bool:
    return (root / Path(*dotted.split("."))).with_suffix(".py").is_file()


def _purge() -> None:
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@contextmanager
def placeholder_imports(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """Register ``modules`` (by dotted name) for the duration of an import, for each top-level package
    that cannot be imported; they are removed again afterwards. An upstream release imports packages at
    module level that the decoder never calls (audio I/O, checkpoint download); the stand-ins let that
    import succeed without them, and raise if anything does call them."""
    missing = {top for top in {name.split(".")[0] for name in modules} if not _importable(top)}
    added = []
    for name, mod in modules.items():
        if name.split(".")[0] not in missing or name in sys.modules:
            continue
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _inert(name: str) -> types.ModuleType:
    """A module whose every attribute raises: for an import the stepaudio2 decoder never uses."""
    mod = types.ModuleType(name, "cadence_fx placeholder: imported but unused by the stepaudio2 decoder")

    def _missing(attr: str) -> object:
        # AttributeError (not ImportError) so that hasattr()/inspect probing keeps working
        raise AttributeError(f"{name} is not installed; cadence_fx only satisfied an unused import "
                             f"of it (attribute {attr!r} requested)")

    mod.__getattr__ = _missing  # type: ignore[method-assign]
    return mod


@contextmanager
def _dynamo_config_preserved() -> Iterator[None]:
    # upsample_encoder_v2.py sets torch._dynamo.config.suppress_errors / cache_size_limit at
    # import time; keep the process-wide settings the user had.
    import torch._dynamo

    cfg = torch._dynamo.config
    saved = {k: getattr(cfg, k) for k in ("suppress_errors", "cache_size_limit")}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)
