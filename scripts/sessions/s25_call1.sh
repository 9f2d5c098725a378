# session 25, call 1: an 8-lane worker's start from a saved artifact after the zero-state change
# (StateStore.preserved zeroes all-zero state again instead of a host round trip), 2 full lanes and 1;
# then SRcb alone (branch streams inside the graphs: the candidate for SRc's default, item 6)
export OUT=${OUT:-.out}; mkdir -p $OUT/cold $OUT/srcb
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"
OUT=$OUT/cold timeout 300 bash scripts/gpu.sh cold --lanes 8 --chunks 4 --full-lanes 2,1 2>&1 | grep "\[cold\]" | tail -4
OUT=$OUT/srcb timeout 250 bash scripts/gpu.sh cells SRcb > /dev/null 2>&1
grep -v "_warn_once" $OUT/srcb/bench.log | tail -8
