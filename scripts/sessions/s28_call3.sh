# session 28, call 3 (planned): Moshi at 80 ms in 60 s rows on four worker processes sharing the GPU under
# MPS (2 lanes each, 3 branch streams, no profiler window): one process's 5 collapsed in session 26 with the
# LM's graph launches on one interpreter and one context; then the vendor's one process per conversation
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cad timeout 575 bash scripts/gpu.sh moshi-cadence --cells SRc,stock --sessions 6,8,12 --stock-sessions 3,4 \
    --procs-per-gpu 4 --mps --lanes 2 --seconds 60 --warm-seconds 2 --branches 3 --busy-window 0 \
    --time-budget 560 --row-slack 5 > /dev/null 2>&1
grep -v "_warn_once" $OUT/cad/moshi-cadence.log | tail -10
python3 -c "import json; r=json.load(open('$OUT/cad/moshi-cadence.json')); print('mps', r['setup'].get('mps'))"
