"""The shape of the code, checked from the source: layers, private names, module sizes, basenames.

Each check reads ``cadence_fx/`` with :mod:`ast` (no import runs), so a change that breaks one names
the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "cadence_fx"
FILES = sorted(p for p in ROOT.rglob("*.py"))
MAX_LINES = 400

# Layers, lowest first: a module may import its own layer and the ones below, never one above.
# ``analysis``: what the passes and the runtime both read off a graph; ``runtime``: what lives across
# calls; ``passes``: the rewriting; then the façade and the artifact that build programs from both;
# adapters and tools on top.
LAYERS = [
    ("base", ("cadence_fx.contract", "cadence_fx.annotations", "cadence_fx.progress", "cadence_fx.determinism",
              "cadence_fx.binding", "cadence_fx.kernel_settings", "cadence_fx.gc_paused")),
    ("analysis", ("cadence_fx.analysis",)),
    ("runtime", ("cadence_fx.runtime",)),
    ("passes", ("cadence_fx.passes", "cadence_fx.pipeline", "cadence_fx.plan", "cadence_fx.export", "cadence_fx.buffer_regions",
                "cadence_fx.shared_weights")),
    ("program", ("cadence_fx.program", "cadence_fx.build", "cadence_fx.artifact")),
    ("top", ("cadence_fx.testing", "cadence_fx.adapters", "cadence_fx.cli", "cadence_fx.serve", "cadence_fx")),
]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    best, rank = -1, len(LAYERS)
    for i, (_name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


MODULES = {_module(p) for p in FILES}


def _imports(path: Path):
    """(line, imported module, names, at module level) of every cadence_fx import in ``path``; ``from
    package import submodule`` counts as an import of the submodule."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cadence_fx"):
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{node.module}.{n}" in MODULES]
            for n in subs:
                yield node.lineno, f"{node.module}.{n}", [], id(node) in top
            if len(subs) < len(names):
                yield node.lineno, node.module, [n for n in names if n not in subs], id(node) in top
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cadence_fx"):
                    yield node.lineno, a.name, [], id(node) in top


def _type_checking_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for path in FILES:
        mine = _module(path)
        guarded = _type_checking_lines(path)
        for line, target, _names, _top in _imports(path):
            if line in guarded:
                continue  # annotations only: no import at run time
            if _layer(target) > _layer(mine):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {mine} ({LAYERS[_layer(mine)][0]}) imports "
                           f"{target} ({LAYERS[_layer(target)][0]})")
    assert not bad, "\n".join(bad)


def test_no_runtime_module_imports_a_pass():
    """At run time: a name used only in annotations (``if TYPE_CHECKING``) is no import."""
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: imports {target}"
           for path in FILES if _module(path).startswith("cadence_fx.runtime")
           for line, target, _n, _t in _imports(path)
           if target.startswith("cadence_fx.passes") and line not in _type_checking_lines(path)]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: from {target} import {name}"
           for path in FILES for line, target, names, _t in _imports(path)
           for name in names if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_import_hides_inside_a_function():
    """An import inside a function hides a layering problem (a cycle dodged) unless it defers an
    optional or slow dependency; those say so on the line (``# deferred: ...``)."""
    bad = []
    for path in FILES:
        lines = path.read_text().splitlines()
        guarded = _type_checking_lines(path)
        for line, target, _names, top in _imports(path):
            if not top and line not in guarded and "deferred:" not in lines[line - 1]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: import of {target} inside a function")
    assert not bad, "\n".join(bad)


def test_module_basenames_are_unique_in_the_library_core():
    """One name per concept. The adapters are exempt: each model's package has the same parts
    (config, build, contracts, steps, driver), named the same so one reads like the other."""
    seen: dict[str, list[str]] = {}
    for path in FILES:
        if path.name == "__init__.py" or "adapters" in path.parts:
            continue
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dup, dup


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT.parent)) for p in FILES])
def test_a_long_module_says_why(path):
    n = len(path.read_text().splitlines())
    if n <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Why one module" in doc, (f"{path.relative_to(ROOT.parent)} has {n} lines (> {MAX_LINES}) and its "
                                     f"docstring does not say why it is one module ('Why one module: ...')")
