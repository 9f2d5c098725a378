# session 22, call 1: the CUDA session tests (pinned sessions among them), Moshi with pinned sessions
# (frames back to back and a profile of 4), then Moshi rows at 80 ms with pinned sessions
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"
timeout 110 python3 -m pytest -q -m cuda tests/test_sessions_cuda.py tests/test_held_streams.py -rxX 2>&1 | tail -4
M="python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor"
timeout 170 $M --pin --throughput 1,2,4,6,7 --profile 4 --profile-frames 10 --json $OUT/ms-pin.json 2>&1 | grep -v "USDT\|_warn_once" | tail -16
OUT=$OUT/cad timeout 250 bash scripts/gpu.sh moshi-cadence --cells SRc --pin --sessions 4,5,6,7 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 240 --row-slack 5 > /dev/null 2>&1
tail -9 $OUT/cad/moshi-cadence.log
