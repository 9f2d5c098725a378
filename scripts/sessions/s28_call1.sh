# session 28, call 1 (planned): the stock fp32 driver's 12 first (three calls in a row cut it by the time
# budget when it ran last), then SRc fp32 at 52 and 54, 16 lanes, locked draw replay; the solo digests
# from session 27's call 1 (same model, dtype, chunks, scripts and torch; the device is checked)
export OUT=${OUT:-.out}; mkdir -p $OUT/fp32
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/fp32 timeout 575 bash scripts/gpu.sh cadence --cells stock,SRc --gpus 1 --sessions 52,54 \
    --stock-sessions 12 --lanes 16 --seconds 60 --warm-seconds 5 --solo-from docs/results/session27/call1/cadence.json \
    --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/fp32/cadence.log | tail -12
