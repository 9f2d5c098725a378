# session 26, call 3: SRc alone with replay="auto"'s one-lane default after confining matrix products to
# two streams was measured slower (call 2): three branch streams, each may run them (item 6); then Moshi
# on one stream and with the same branches (SR, SRb), each in a fresh process: is the default no slower there
export OUT=${OUT:-.out}; mkdir -p $OUT/src $OUT/moshi
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/src timeout 220 bash scripts/gpu.sh cells SRc > /dev/null 2>&1
grep -v "_warn_once" $OUT/src/bench.log | grep "^SRc \|p50" | tail -6
OUT=$OUT/moshi FRAMES=300 timeout 340 bash scripts/gpu.sh moshi SR,SRb > /dev/null 2>&1
grep -v "_warn_once" $OUT/moshi/moshi.log | tail -12
