export OUT=${OUT:-.out}; mkdir -p $OUT/locked $OUT/lockless $OUT/conn32
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m cuda tests/test_sessions_cuda.py -k "random_stream or beside or one_lane_that_draws" -rxX 2>&1 | tail -25 | tee $OUT/tests.log
OUT=$OUT/locked timeout 160 bash scripts/gpu.sh moshi-cadence --cells SRc,stock --sessions 2,4 --stock-sessions 3 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 150 --row-slack 5 > /dev/null 2>&1
tail -5 $OUT/locked/moshi-cadence.log
CADENCE_FX_LOCKLESS_DRAW_REPLAY=1 OUT=$OUT/lockless timeout 130 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 2,4,8 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 120 --row-slack 5 > /dev/null 2>&1
tail -5 $OUT/lockless/moshi-cadence.log
CUDA_DEVICE_MAX_CONNECTIONS=32 CADENCE_FX_LOCKLESS_DRAW_REPLAY=1 OUT=$OUT/conn32 timeout 110 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 4,8 --lanes 8 --seconds 20 --warm-seconds 2 --time-budget 100 --row-slack 5 > /dev/null 2>&1
tail -5 $OUT/conn32/moshi-cadence.log
