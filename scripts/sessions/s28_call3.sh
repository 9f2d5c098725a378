# session 28, call 3 (planned): Moshi at 80 ms in 60 s rows (session 26's were 20 s): 4 and 5 conversations on
# 8 lanes with branch streams, no profiler window, the vendor's one process per conversation (3, 4) in the
# same run
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cad timeout 575 bash scripts/gpu.sh moshi-cadence --cells stock,SRc --sessions 4,5 --stock-sessions 3,4 \
    --lanes 8 --seconds 60 --warm-seconds 2 --branches 3 --busy-window 0 --time-budget 560 --row-slack 5 \
    > /dev/null 2>&1
grep -v "_warn_once" $OUT/cad/moshi-cadence.log | tail -10
