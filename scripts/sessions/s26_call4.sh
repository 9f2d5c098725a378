# session 26, call 4: Moshi conversations per H200 at 80 ms with three branch streams inside each lane's
# graphs (item 3): call 3 measured a lone Moshi frame 18 % faster with them, the same bytes
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
OUT=$OUT/cad timeout 400 bash scripts/gpu.sh moshi-cadence --cells SRc --sessions 3,4,5 --lanes 8 --seconds 20 \
    --warm-seconds 2 --branches 3 --time-budget 380 --row-slack 5 > /dev/null 2>&1
grep -v "_warn_once" $OUT/cad/moshi-cadence.log | tail -10
