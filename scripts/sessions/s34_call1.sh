# session 34, call 1: is the fourth MPS worker's failed start the connection pool? (NVIDIA's MPS docs:
# each client owns the CUDA_DEVICE_MAX_CONNECTIONS it asks for, out of one pool; the workers ask for 32.)
# First the probe counts the clients that start per setting under the benchmark's own daemon; then the
# four-worker Moshi run (2 lanes each, one copy of the LM weights) with the largest setting that let
# four clients start. On an H100 the solo digests are session 32's call 2's (--solo-from checks them).
export OUT=${OUT:-.out}; mkdir -p $OUT
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
timeout 150 python3 scripts/sessions/s34_conn_probe.py 32,16,8 ${PROBE_MAX:-6} 2>&1 | tee $OUT/probe.txt
procs=${PROCS:-4}
conn=$(python3 - "$procs" <<'PY'
import os, re, sys
need = int(sys.argv[1])
ups = {int(c): int(n) for c, n in re.findall(r"^connections (\d+): (\d+) clients up", open(os.environ["OUT"] + "/probe.txt").read(), re.M)}
ok = [c for c, n in ups.items() if n >= need]
print(max(ok) if ok else 8)
PY
)
echo "connections for $procs workers: $conn"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
extra="--share-weights --cuda-connections $conn"
if [ "$mib" -lt 100000 ]; then
  extra="$extra --solo-from docs/results/session32/call2/moshi-cadence.json"; sessions=5,6,8
else
  sessions=6,7,8
fi
PROCS=$procs LANES=${LANES:-2} SESSIONS=${SESSIONS:-$sessions} STOCK=${STOCK:-2} EXTRA="$extra" \
    LIMIT=${LIMIT:-430} bash scripts/sessions/s30_call2.sh
grep -h "LM weights" $OUT/cad/moshi-cadence.log | head -4
