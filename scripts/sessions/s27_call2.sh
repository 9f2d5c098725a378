# session 27, call 2: float16 Token2Wav at 64 and 68 conversations, 16 lanes, the locked draw replay (call 1: lockless slower in fp32)
# draw replay and then the locked one (session 26's 64 locked: 0 misses, p99 501 ms), the stock float16
# driver's 12 in the same run if the time budget leaves room
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 575 bash scripts/gpu.sh cadence --cells SRc,stock --dtype float16 --gpus 1 --sessions 64,68 \
    --stock-sessions 12 --lanes 16 --seconds 60 --warm-seconds 5 --draw-replay lock \
    --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -14
