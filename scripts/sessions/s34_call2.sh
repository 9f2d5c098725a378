# session 34, call 2: released float16 Token2Wav at N=64 with four worker processes of 4 lanes under MPS
# (session 30's H100 row ran two of 8 lanes: 98 % busy at 5.2 kernels at once, 2,891 misses). Four MPS
# clients start only with CUDA_DEVICE_MAX_CONNECTIONS <= 16 (call 1's probe), hence --cuda-connections 16.
export OUT=${OUT:-.out}; mkdir -p $OUT/f16
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUT=$OUT/f16 timeout ${LIMIT:-560} bash scripts/gpu.sh cadence --cells SRc --dtype float16 --gpus 1 --sessions ${SESSIONS:-64} \
    --procs-per-gpu ${PROCS:-4} --mps --lanes ${LANES:-4} --cuda-connections ${CONN:-16} --seconds 60 --warm-seconds 5 \
    --time-budget $((${LIMIT:-560} - 15)) > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/f16/cadence.log | tail -24
python3 -c "import json; r=json.load(open('$OUT/f16/cadence.json')); print('mps', r['setup'].get('mps')); [print(x['n_sessions'], x['counters']) for x in r['rows']]"
