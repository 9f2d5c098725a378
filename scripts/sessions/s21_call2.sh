export OUT=${OUT:-.out}
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
M="python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor --profile 4 --profile-frames 10"
timeout 150 $M --throughput 1,2,4,8 --trace $OUT/trace-n4.json --json $OUT/ms-default.json 2>&1 | grep -v "USDT\|_warn_once" | tail -22
gzip -f $OUT/trace-n4.json; ls -la $OUT
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 130 $M --throughput 2,4,8 --json $OUT/ms-conn32.json 2>&1 | grep -v "USDT\|_warn_once" | tail -20
CUDA_DEVICE_MAX_CONNECTIONS=32 CADENCE_FX_LOCKLESS_DRAW_REPLAY=1 timeout 130 $M --throughput 2,4,8 --json $OUT/ms-conn32-lockless.json 2>&1 | grep -v "USDT\|_warn_once" | tail -20
