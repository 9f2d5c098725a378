# session 30, call 2: s28_call3.sh (Moshi at 80 ms, worker processes under MPS, then the vendor's one process
# per conversation) sized to the GPU it lands on: each worker holds its own 14.7 GB of LM weights, so four
# workers of 2 lanes fit an H200's 141 GB but not an H100's 80; there two workers of 4 lanes run instead
export OUT=${OUT:-.out}; mkdir -p $OUT/cad
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mib" -gt 100000 ]; then procs=4 lanes=2 sessions=6,8,12; else procs=2 lanes=4 sessions=5,6,8; fi
procs=${PROCS:-$procs} lanes=${LANES:-$lanes} sessions=${SESSIONS:-$sessions}   # session 31: rows below the first miss
echo "procs $procs lanes $lanes sessions $sessions stock ${STOCK:-3,4}"
OUT=$OUT/cad timeout ${LIMIT:-575} bash scripts/gpu.sh moshi-cadence --cells SRc,stock --sessions $sessions \
    --stock-sessions ${STOCK:-3,4} --procs-per-gpu $procs --mps --lanes $lanes --seconds 60 --warm-seconds 2 --branches 3 \
    --busy-window 0 --time-budget $((${LIMIT:-575} - 15)) --row-slack 5 ${EXTRA:-} > /dev/null 2>&1
grep -v "_warn_once" $OUT/cad/moshi-cadence.log | tail -12
python3 -c "import json; r=json.load(open('$OUT/cad/moshi-cadence.json')); print('mps', r['setup'].get('mps')); [print(x.get('cell'), x['n_sessions'], x.get('counters')) for x in r['rows']]"
