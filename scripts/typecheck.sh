#!/usr/bin/env bash
# The typecheck step: mypy on the public API modules (pyproject.toml's [tool.mypy] files: the contract,
# the program façade and its build seam, sessions, warm-up and census, the artifact package) must
# report 0 errors, or this fails; the error count for the whole package (`mypy cadence_fx`) is
# printed beside it, reported, not failing.
#
#   scripts/typecheck.sh          # from anywhere; uses .venv/bin/python when the checkout has one
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python

echo "== mypy: public API modules (must be 0 errors)"
"$PY" -m mypy
public=$?

echo "== mypy: the whole package (reported)"
whole=$("$PY" -m mypy cadence_fx 2>&1 | tail -n 1)
echo "$whole"
case "$whole" in
  Success*) echo "whole package: 0 errors" ;;
  Found*) echo "whole package: $(echo "$whole" | sed -E 's/^Found ([0-9]+) errors?.*/\1/') errors" ;;
esac
exit $public
