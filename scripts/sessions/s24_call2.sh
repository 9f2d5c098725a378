# session 24, call 2: an 8-lane worker's start from a saved artifact with every lane capturing every class
# against full lanes 1 and 2 (the others capture the steady class only), each a fresh process with its streams
# SHA-256-gated; then float16 Token2Wav above 60 (16 lanes, 60 s rows, kernels at once and fill per row)
export OUT=${OUT:-.out}; mkdir -p $OUT/cold $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cold timeout 300 bash scripts/gpu.sh cold --lanes 8 --chunks 4 --full-lanes all,1,2 2>&1 | grep "\[cold\]" | tail -4
OUT=$OUT/f16 timeout 280 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64,68 --lanes 16 \
    --seconds 60 --warm-seconds 5 --time-budget 265 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -8
