# session 27, call 1: fp32 Token2Wav at 52 and 56 conversations, 16 lanes, each N with the lockless draw
# replay (per-lane generator states, no draw lock) and then the locked one, on the same workers; the stock
# driver's 12 in the same run if the time budget leaves room
export OUT=${OUT:-.out}; mkdir -p $OUT/fp32
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/fp32 timeout 575 bash scripts/gpu.sh cadence --cells SRc,stock --gpus 1 --sessions 52,56 \
    --stock-sessions 12 --lanes 16 --seconds 60 --warm-seconds 5 --draw-replay lockless,lock \
    --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/fp32/cadence.log | tail -14
