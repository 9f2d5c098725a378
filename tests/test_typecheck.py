"""The typecheck step: mypy reports no error on the public API modules.

The modules are ``[tool.mypy] files`` in pyproject.toml (what ``scripts/typecheck.sh`` checks); the
count for the rest of the package is reported by the script, not asserted. Skipped without mypy
(``pip install -e .[test]`` brings it); its cache (``.mypy_cache``) keeps a rerun to seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]


def test_the_public_api_modules_type_check():
    cwd = os.getcwd()
    os.chdir(ROOT)  # pyproject.toml's [tool.mypy] names the files, relative to the checkout
    try:
        out, err, status = api.run([])
    finally:
        os.chdir(cwd)
    assert status == 0 and "Success" in out, f"mypy on the public API modules:\n{out}{err}"
