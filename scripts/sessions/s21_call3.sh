export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
M="python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor --profile 4 --profile-frames 10"
timeout 150 $M --throughput 1,2,4,8 --trace $OUT/trace-n4.json --json $OUT/ms-foreach.json 2>&1 | grep -v "USDT\|_warn_once\|acc_events" | tail -22
gzip -f $OUT/trace-n4.json
OUT=$OUT/cad timeout 200 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 3,4,6 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 190 --row-slack 5 > /dev/null 2>&1
tail -8 $OUT/cad/moshi-cadence.log
