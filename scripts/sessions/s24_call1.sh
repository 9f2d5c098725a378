# session 24, call 1: the CUDA replay tests (outputs' aliasing, new in session 23), then fp32 Token2Wav above 50
# with the journal off (the default since session 22: no journal kernels or buffers), 16 lanes, 60 s rows,
# with each row's kernels at once and how full their occupancy kept the GPU (warp and SM fill)
export OUT=${OUT:-.out}; mkdir -p $OUT/t2w
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"
timeout 100 python3 -m pytest -q -m cuda tests/test_replay_cuda.py -rxX 2>&1 | tail -4
OUT=$OUT/t2w timeout 470 bash scripts/gpu.sh cadence --cells SRc --gpus 1 --sessions 54,58,62 --lanes 16 --seconds 60 \
    --warm-seconds 5 --time-budget 450 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/t2w/cadence.log | tail -12
