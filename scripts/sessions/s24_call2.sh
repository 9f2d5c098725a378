# session 24, call 2: an 8-lane worker's start from a saved artifact with every lane capturing every class
# against full lanes 1 and 2 (the others capture the steady class only), each a fresh process with its streams
# SHA-256-gated (and what the profiler's kernel records carry, for the fill figures)
export OUT=${OUT:-.out}; mkdir -p $OUT/cold $OUT/moshi
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
timeout 30 python3 scripts/sessions/probe_kineto.py 2>&1 | tail -3
OUT=$OUT/cold timeout 300 bash scripts/gpu.sh cold --lanes 8 --chunks 4 --full-lanes all,1,2 2>&1 | grep "\[cold\]" | tail -4
