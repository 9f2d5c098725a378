# session 25, call 2: fp32 Token2Wav at and above session 24's 50 with branch streams inside each lane's
# graphs (--branches 3 --blas-streams 2, SRchb2's plan), 16 lanes, 60 s rows, journal off
export OUT=${OUT:-.out}; mkdir -p $OUT/t2w
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/t2w timeout 560 bash scripts/gpu.sh cadence --cells SRc --gpus 1 --sessions 52,56 --lanes 16 --seconds 60 \
    --warm-seconds 5 --branches 3 --blas-streams 2 --time-budget 540 --full-sweep > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/t2w/cadence.log | tail -8
