# session 29, call 2 (a short budget): does the float16 export on this GPU still mark its attention as a
# draw? The SDPA probe, then a reduced-size float16 cadence row (8 sessions, 10 s) whose counters name
# the wrapped callables that draw: after the fused-attention fix, only the vocoder
export OUT=${OUT:-.out}; mkdir -p $OUT/f16r
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/sessions/s28_sdpa_export.py 2>&1 | grep -v Warning | tail -10
OUT=$OUT/f16r timeout ${LIMIT:-300} bash scripts/gpu.sh cadence --cells SRc --dtype float16 --reduced --gpus 1 \
    --sessions 8 --lanes 2 --seconds 10 --warm-seconds 2 --time-budget $((${LIMIT:-300} - 15)) > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16r/cadence.log | tail -8
python3 -c "import json; r=json.load(open('$OUT/f16r/cadence.json')); [print(x['n_sessions'], x['counters']) for x in r['rows']]"
