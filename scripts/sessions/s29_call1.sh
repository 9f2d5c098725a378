# session 29, call 1: float16 with the fused-attention draw fix (the flow's attention kernels no longer
# count as draws, so only HiFT's replay takes the draws' lock): the same row as s28_call2_h100.sh (two
# worker processes under MPS, 8 lanes each, N=64) on whichever card comes, the solo stock digests taken
# in the run; `drawing` in the counters should name only the vocoder, and the lock ~1 take per chunk
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/sessions/s28_sdpa_export.py > $OUT/sdpa_export.txt 2>&1; tail -6 $OUT/sdpa_export.txt
OUT=$OUT/f16 timeout 575 bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions 64,72 \
    --procs-per-gpu 2 --mps --lanes 8 --seconds 60 --warm-seconds 5 --time-budget 560 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -14
python3 -c "import json; r=json.load(open('$OUT/f16/cadence.json')); print('mps', r['setup'].get('mps')); [print(x['n_sessions'], x['counters']) for x in r['rows']]"
