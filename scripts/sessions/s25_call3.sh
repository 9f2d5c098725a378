# session 25, call 3: float16 Token2Wav above session 21's 60 (16 lanes), 60 s rows
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 560 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64,68 --lanes 16 \
    --seconds 60 --warm-seconds 5 --time-budget 540 --full-sweep > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -8
