# session 32, call 4: four Moshi workers on one H100 with one copy of the LM weights (--share-weights:
# slot 0 publishes its LM's parameters through CUDA IPC, slots 1-3 map them once bitwise equal to their
# own). Call 3's three workers held three copies (69.5 GB at N=6) and made 5 exact; a fourth copy does
# not fit an H100. Calls 4 and 5 failed a fourth worker's first allocation (cause not established); the
# workers of a GPU now build and map before any captures. First the two-process CUDA test of the mapping, then the rows; the solo digests are
# call 2's (same H100, torch, scripts, chunks) so no solo process holds 17 GB while the workers build.
export PYTHONPATH=$PWD
python3 -m pytest -q -m cuda tests/test_process_weights.py -s 2>&1 | grep -v "^$" | tail -4
PROCS=${PROCS:-4} LANES=${LANES:-2} SESSIONS=${SESSIONS:-5,6,7,8} STOCK=${STOCK:-2} \
    EXTRA="--share-weights --solo-from docs/results/session32/call2/moshi-cadence.json" bash scripts/sessions/s30_call2.sh
grep -h "LM weights" $OUT/cad/moshi-cadence.log | head -4
