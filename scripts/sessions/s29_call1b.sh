# session 29, call 1b: s29_call1.sh cut to what a short device budget holds: N=64 only (two worker
# processes under MPS, 8 lanes each, 60 s), the solo stock digests taken in the run; `drawing` in the
# counters should name only the vocoder and the draws' lock ~1 take per chunk (the fused-attention fix)
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUT=$OUT/f16 timeout ${LIMIT:-500} bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64 \
    --procs-per-gpu 2 --mps --lanes 8 --seconds 60 --warm-seconds 5 --time-budget $((${LIMIT:-500} - 15)) > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -14
python3 -c "import json; r=json.load(open('$OUT/f16/cadence.json')); print('mps', r['setup'].get('mps')); [print(x['n_sessions'], x['counters']) for x in r['rows']]"
