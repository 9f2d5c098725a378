# session 27, call 3: float16 Token2Wav at 64, lockless draw replay then locked again on the same workers
# (call 2's locked 64 collapsed with the draws' lock waited on 907 s across 16 lanes in a 60 s row)
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 420 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64 \
    --lanes 16 --seconds 60 --warm-seconds 5 --draw-replay lockless,lock --time-budget 410 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -8
