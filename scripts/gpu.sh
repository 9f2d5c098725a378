#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels (the machine has no package index), then run
#   scripts/gpu.sh tests            the CUDA tests (pytest -m cuda)
#   scripts/gpu.sh cells B0,SRc     benchmark cells, each in a fresh process
#   LANES=2 scripts/gpu.sh cells B0,SRc/B0,S   two lanes side by side, one GPU each (nvidia-h200-x2)
#   scripts/gpu.sh cadence --sessions 8,16,32   conversations per GPU (benchmarks/cadence.py)
# Output goes to $OUT (default .out/): gpu-tests.log, bench.log, rows.jsonl (raw rows of every cell run).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CADENCE_FX_UPSTREAM="$PWD/.upstream" PYTHONUNBUFFERED=1
OUT="${OUT:-.out}"
mkdir -p "$OUT"
case "${1:-}" in
  tests) python3 -m pytest -q -m cuda tests/ -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu-tests.log" ;;
  cells) python3 benchmarks/token2wav.py --blocks 4 --chunks 24 --lanes "${LANES:-1}" --cells "$2" --rows "$OUT/rows.jsonl" \
           --json "$OUT/token2wav-partial.json" 2>&1 | tee -a "$OUT/bench.log" ;;
  cadence) shift; python3 benchmarks/cadence.py --json "$OUT/cadence.json" "$@" 2>&1 | tee -a "$OUT/cadence.log" ;;
  *) echo "usage: scripts/gpu.sh tests | cells CELL[,CELL...] | cadence [benchmarks/cadence.py flags]" >&2; exit 2 ;;
esac
