# session 32, call 1: does a third (H100) or fourth (H200) worker process under MPS add Moshi conversations?
# Session 31 found two workers of 2 lanes saturate an H100 at 4 (nvml 1.00) and 2 x 4 lanes miss at 5;
# one more process is the remaining lever short of batching (which would change the bytes). Each worker
# holds its own 14.7 GB of LM weights (~23 GB a worker at 2 lanes), so three fit an H100, four an H200.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 100000 ]; then
    PROCS=4 LANES=2 SESSIONS=${SESSIONS:-5,6,8} STOCK=${STOCK:-2} bash scripts/sessions/s30_call2.sh
else
    PROCS=3 LANES=2 SESSIONS=${SESSIONS:-5,6} STOCK=${STOCK:-2} bash scripts/sessions/s30_call2.sh
fi
# call 1 on an H100 ran out of memory at start-up: the solo stock process (17 GB, the vendor's LM) runs
# while the workers build. Call 3 adopts call 2's solo digests (same H100, torch, scripts and chunks:
# `--solo-from` refuses any other) so only the three workers hold the GPU:
#   EXTRA="--solo-from docs/results/session32/call2/moshi-cadence.json" bash scripts/sessions/s32_call1.sh
