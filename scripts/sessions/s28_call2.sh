# session 28, call 2 (planned): float16 at 60 and 64, lock-free draw replay then locked on the same workers
# (session 27's locked 64 collapsed on the draws' lock on a slow host; its lock-free row was cut by the budget)
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 575 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 60,64 \
    --lanes 16 --seconds 60 --warm-seconds 5 --draw-replay lockless,lock \
    --solo-from docs/results/session27/call2/cadence.json --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -12
