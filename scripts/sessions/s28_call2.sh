# session 28, call 2 (planned): float16 on two worker processes sharing the GPU under an MPS daemon of the
# run's own (8 lanes each, an interpreter and a draws' lock each): session 27's one-process 64 collapsed on
# the draws' lock and the interpreter on a slow host. setup.mps in the report says whether MPS ran.
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 575 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64,72,80 \
    --procs-per-gpu 2 --mps --lanes 8 --seconds 60 --warm-seconds 5 \
    --solo-from docs/results/session27/call2/cadence.json --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -12
python3 -c "import json; r=json.load(open('$OUT/f16/cadence.json')); print('mps', r['setup'].get('mps'))"
