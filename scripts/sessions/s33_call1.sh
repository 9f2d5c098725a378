# session 33, call 1: four Moshi workers (2 lanes each, MPS) with one copy of the LM weights
# (--share-weights), on whichever GPU comes. Session 32's calls 4 and 5 failed a fourth worker's first
# allocation on an H100 while the others built and captured; the workers of a GPU now build and map one
# at a time before any exports or captures. On an H100 the solo digests are session 32's call 2's (same
# GPU model, torch, scripts, chunks: --solo-from refuses any other); on an H200 the run takes its own.
# A sampler beside the run writes the GPU's memory per process every 5 s (apps.txt) for the start-up.
export OUT=${OUT:-.out}; mkdir -p $OUT
export PYTHONPATH=$PWD
(while true; do date +%T; nvidia-smi --query-gpu=memory.used --format=csv,noheader
 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 5; done) > $OUT/apps.txt 2>&1 &
sampler=$!
python3 -m pytest -q -m cuda tests/test_process_weights.py 2>&1 | tail -1
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
extra="--share-weights"
[ "$mib" -lt 100000 ] && extra="$extra --solo-from docs/results/session32/call2/moshi-cadence.json"
PROCS=${PROCS:-4} LANES=${LANES:-2} SESSIONS=${SESSIONS:-5,6,8} STOCK=${STOCK:-2} EXTRA="$extra" \
    bash scripts/sessions/s30_call2.sh
grep -h "LM weights" $OUT/cad/moshi-cadence.log | head -4
kill $sampler
