# session 28, call 2 on an H100 (the H200s were not lent): float16 on two worker processes sharing the GPU
# under an MPS daemon of the run's own (8 lanes each), the solo stock digests taken in the run (the earlier
# reports' are an H200's)
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/f16 timeout 575 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64,72 \
    --procs-per-gpu 2 --mps --lanes 8 --seconds 60 --warm-seconds 5 --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -14
python3 -c "import json; r=json.load(open('$OUT/f16/cadence.json')); print('mps', r['setup'].get('mps')); [print(x['n_sessions'], x['counters']) for x in r['rows']]"
