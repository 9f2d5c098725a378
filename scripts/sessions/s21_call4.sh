export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -m cuda tests/test_sessions_cuda.py tests/test_held_streams.py -rxX 2>&1 | tail -4
OUT=$OUT/cad timeout 330 bash scripts/gpu.sh moshi-cadence --cells SRc,stock --sessions 3,4 --stock-sessions 3,4 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 320 --row-slack 5 > /dev/null 2>&1
tail -9 $OUT/cad/moshi-cadence.log
