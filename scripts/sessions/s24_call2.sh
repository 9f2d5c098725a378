# session 24, call 2: an 8-lane worker's start from a saved artifact with every lane capturing every class
# against full lanes 1 and 2 (the others capture the steady class only), each a fresh process with its streams
# SHA-256-gated; then Moshi rows at 80 ms with shared sessions and the journal off (the default since session 22)
export OUT=${OUT:-.out}; mkdir -p $OUT/cold $OUT/moshi
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
timeout 30 python3 scripts/sessions/probe_kineto.py 2>&1 | tail -3
OUT=$OUT/cold timeout 300 bash scripts/gpu.sh cold --lanes 8 --chunks 4 --full-lanes all,1,2 2>&1 | grep "\[cold\]" | tail -4
OUT=$OUT/moshi timeout 250 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 3,4,5 --lanes 8 --seconds 20 \
    --warm-seconds 2 --time-budget 235 --row-slack 5 > /dev/null 2>&1
grep -v "chunks$\|frames$\|_warn_once" $OUT/moshi/moshi-cadence.log | tail -6
