# session 22, call 2: Moshi frames back to back, pinned against shared sessions in one run (after the
# journal covers counters and carries), then Moshi rows at 80 ms with pinned sessions
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
M="python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor --throughput 2,4,6 --profile 4 --profile-frames 10"
timeout 150 $M --pin --json $OUT/ms-pin.json 2>&1 | grep -v "USDT\|_warn_once" | grep -v "^  cuda[A-Z]" | tail -8
timeout 150 $M --json $OUT/ms-shared.json 2>&1 | grep -v "USDT\|_warn_once" | grep -v "^  cuda[A-Z]" | tail -8
OUT=$OUT/cad timeout 200 bash scripts/gpu.sh moshi-cadence --cells SRc --pin --sessions 3,4 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 190 --row-slack 5 > /dev/null 2>&1
tail -5 $OUT/cad/moshi-cadence.log
