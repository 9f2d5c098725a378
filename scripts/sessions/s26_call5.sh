# session 26, call 5: call 4 again without the profiler window (--busy-window 0): all of call 4's 32 misses
# at N=3 came after the window opened (misses_while_profiling 32 of 32)
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cad timeout 400 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 3,4,5 --lanes 8 --seconds 20 \
    --warm-seconds 2 --branches 3 --busy-window 0 --time-budget 380 --row-slack 5 > /dev/null 2>&1
grep -v "_warn_once" $OUT/cad/moshi-cadence.log | tail -8
