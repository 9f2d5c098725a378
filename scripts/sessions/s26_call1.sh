# session 26, call 1: the CUDA tests after replay="auto" gives a one-lane program branch streams (every
# test program of one lane now captures branched), then float16 Token2Wav above session 21's 60 (item 2),
# with the stock float16 driver's 12 in the same run
export OUT=${OUT:-.out}; mkdir -p $OUT/tests $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/tests timeout 200 bash scripts/gpu.sh tests > /dev/null 2>&1
tail -4 $OUT/tests/gpu-tests.log
OUT=$OUT/f16 timeout 380 bash scripts/gpu.sh cadence --cells SRc,stock --dtype float16 --gpus 1 --sessions 64,68 \
    --stock-sessions 12 --lanes 16 --seconds 60 --warm-seconds 5 --time-budget 360 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -10
