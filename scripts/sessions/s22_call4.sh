# session 22, call 4: in one machine start, Moshi back to back at N=4: pinned sessions (journal on)
# against shared sessions (journal off)
export OUT=${OUT:-.out}
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
M="python3 benchmarks/moshi_sessions.py --frames 40 --lanes 8 --scripts 1 --concurrent 1 --refs vendor --throughput 4,6"
timeout 110 $M --pin --json $OUT/ms-pin.json 2>&1 | grep "frames/s" | tail -3
timeout 110 $M --no-journal --json $OUT/ms-shared-nojournal.json 2>&1 | grep "frames/s" | tail -3
