# session 22, call 3: does the undo journal cost shared sessions anything (Moshi back to back, journal off,
# against call 2's journal on), then fp32 Token2Wav above 48 (16 lanes, shared sessions, journal on)
export OUT=${OUT:-.out}; mkdir -p $OUT/t2w
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
timeout 130 python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor \
    --throughput 2,4,6 --no-journal --json $OUT/ms-shared-nojournal.json 2>&1 | grep "frames/s\|equal" | tail -8
OUT=$OUT/t2w timeout 400 bash scripts/gpu.sh cadence --cells SRc --gpus 1 --sessions 50 --lanes 16 --seconds 60 \
    --warm-seconds 5 --time-budget 380 > /dev/null 2>&1
tail -5 $OUT/t2w/cadence.log
