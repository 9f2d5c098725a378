# session 26, call 2: an 8-lane worker's start after the collector pause and the direct lane copies
# (item 5), then SRc alone with replay="auto"'s new one-lane default (three branch streams; item 6)
export OUT=${OUT:-.out}; mkdir -p $OUT/cold $OUT/src
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cold timeout 300 bash scripts/gpu.sh cold --lanes 8 --chunks 4 --full-lanes 2 > /dev/null 2>&1
grep -v "_warn_once" $OUT/cold/cold_start.log | tail -6
OUT=$OUT/src timeout 260 bash scripts/gpu.sh cells SRc > /dev/null 2>&1
grep -v "_warn_once" $OUT/src/bench.log | tail -8
