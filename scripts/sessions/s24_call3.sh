# session 24, call 3: fp32 Token2Wav below call 1's 54 (missed), journal off, 16 lanes, 60 s rows
export OUT=${OUT:-.out}; mkdir -p $OUT/t2w
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/t2w timeout 420 bash scripts/gpu.sh cadence --cells SRc --gpus 1 --sessions 50,52 --lanes 16 --seconds 60 \
    --warm-seconds 5 --time-budget 400 --full-sweep > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/t2w/cadence.log | tail -6
