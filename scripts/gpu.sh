#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels (the machine has no package index), then run
#   scripts/gpu.sh tests            the CUDA tests (pytest -m cuda)
#   scripts/gpu.sh cells B0,SRc     benchmark cells, each in a fresh process
#   LANES=2 scripts/gpu.sh cells B0,SRc/B0,S   two lanes side by side, one GPU each (nvidia-h200-x2)
#   T2W_FLAGS="--memory-peak $OUT/mempeak.txt" scripts/gpu.sh cells B0,SRc   extra benchmarks/token2wav.py flags
#   scripts/gpu.sh cadence --sessions 8,16,32   conversations per GPU (benchmarks/cadence.py; --solo-from an
#                                  earlier cadence.json reuses its solo stock digests instead of running them)
#   FRAMES=1000 scripts/gpu.sh moshi B0,vendor,S,R,SR   Moshi cells, each in a fresh process (benchmarks/moshi.py;
#                                  needs moshi 0.2.13: its wheel in .whl/ or .upstream/moshi-0.2.13)
#   MOSHI_FLAGS="--memory-peak $OUT/moshi-peak.txt" FRAMES=100 scripts/gpu.sh moshi SR,vendor   what each peak holds
#   scripts/gpu.sh moshi-cadence --sessions 12,16,20,24 --stock-sessions 1,2,3 --lanes 16 --time-budget 500
#                                  Moshi conversations per GPU at 80 ms (benchmarks/cadence.py --model moshi; needs
#                                  moshi 0.2.13 as for `moshi`): moshi-cadence.json, moshi-cadence-rows.jsonl, .log
#   scripts/gpu.sh cold [--chunks 4]   cold start: export, optimize, save, then load + capture + first chunk
#                                      in a fresh process (benchmarks/cold_start.py), about 3 minutes
#   scripts/gpu.sh code2wav --cells stock,stockb,buckets,cadence --chunks 20   Qwen3-Omni's Code2Wav at released
#                                  sizes, each cell in a fresh process (benchmarks/code2wav.py; needs transformers
#                                  5.24 and what it imports: their wheels in .whl/); _bf16 cells: bfloat16
#   scripts/gpu.sh cadence --cells SRc --gpus 1,2 --sessions 44/84,88 --pack --lanes 8 --warm-seconds 5 \
#       --time-budget 530   the same on one GPU and on two (nvidia-h200-x2), one process per GPU, a warm stream
#                           first, each one-GPU N twice side by side (--pack pairs only rows of the same N)
#   scripts/gpu.sh serve [flags]   Token2Wav served on Ray on one GPU (benchmarks/serve_token2wav.py): worker ready
#                                  time, routing overhead, migration, failover, checkpoint cost; needs Ray and Serve's
#                                  wheels in .whl/ (bash scripts/device_bundle.sh); checks `import ray, ray.serve` first
#   scripts/gpu.sh serve-capacity --artifact /tmp/token2wav-capacity.cfx --sessions 32,44 --seconds 20 --scripts 4 \
#       --time-budget 300
#                                  conversations at 1 s through the front end against in process, one worker with the
#                                  whole GPU (benchmarks/serve_capacity.py; the artifact is built when absent); the
#                                  same Ray check as `serve`: serve-capacity.json (rewritten after every row), .log
# Output goes to $OUT (default .out/): gpu-tests.log, bench.log, rows.jsonl (raw rows of every cell run),
# cadence.json (rewritten after every row), cadence-rows.jsonl, cadence.log, code2wav.json, code2wav-rows.jsonl, code2wav.log,
# serve.json (rewritten after every phase), serve.log, ray-logs/ (the tails of the Ray session's logs),
# serve-capacity.json, serve-capacity.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# once per machine and set of wheels (a warm machine that installed another set installs this one too):
# queues started side by side must not install into one folder at the same time
if ls .whl/*.whl >/dev/null 2>&1; then
  stamp=/tmp/site/.installed-$(ls -l .whl/*.whl | awk '{print $5, $NF}' | md5sum | cut -c1-12)
  if [ ! -e "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch "$stamp" /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CADENCE_FX_UPSTREAM="$PWD/.upstream" PYTHONUNBUFFERED=1
OUT="${OUT:-.out}"
mkdir -p "$OUT"
case "${1:-}" in
  tests) python3 -m pytest -q -m cuda tests/ -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu-tests.log" ;;
  cells) python3 benchmarks/token2wav.py --blocks 4 --chunks 24 --lanes "${LANES:-1}" --cells "$2" --rows "$OUT/rows.jsonl" \
           ${T2W_FLAGS:-} \
           --json "$OUT/token2wav-partial.json" 2>&1 | tee -a "$OUT/bench.log" ;;
  moshi) python3 benchmarks/moshi.py --frames "${FRAMES:-1000}" --cells "${2:-B0,vendor,S,R,SR}" ${MOSHI_FLAGS:-} \
           --rows "$OUT/moshi-rows.jsonl" --json "$OUT/moshi.json" 2>&1 | tee -a "$OUT/moshi.log" ;;
  cadence) shift; python3 benchmarks/cadence.py --json "$OUT/cadence.json" --rows "$OUT/cadence-rows.jsonl" "$@" 2>&1 \
             | tee -a "$OUT/cadence.log" ;;
  moshi-cadence) shift; python3 benchmarks/cadence.py --model moshi --json "$OUT/moshi-cadence.json" \
                   --rows "$OUT/moshi-cadence-rows.jsonl" "$@" 2>&1 | tee -a "$OUT/moshi-cadence.log" ;;
  cold) shift; python3 benchmarks/cold_start.py --json "$OUT/cold_start.json" "$@" 2>&1 | tee -a "$OUT/cold_start.log" ;;
  serve) shift
         python3 -c "import ray, ray.serve; print('ray', ray.__version__, 'with serve, from', ray.__file__)" || {
           echo "gpu.sh serve: Ray does not import here (build .whl/ with scripts/device_bundle.sh and carry it)" >&2
           exit 3; }
         # what Serve's runtime imports beyond ray.serve (its controller, proxy, replica), and the versions it met
         python3 -c "import ray.serve._private.controller, ray.serve._private.proxy, ray.serve._private.replica, \
fastapi, pydantic, uvicorn, websockets, grpc, google.protobuf as pb; print('serve runtime imports:', 'fastapi', \
fastapi.__version__, 'pydantic', pydantic.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)" \
           || echo "gpu.sh serve: Serve's runtime does not import (the benchmark uses Ray core only: going on)" >&2
         df -h /dev/shm /tmp 2>/dev/null | sed 's/^/  /'
         python3 benchmarks/serve_token2wav.py --json "$OUT/serve.json" --ray-logs "$OUT/ray-logs" "$@" 2>&1 \
           | tee -a "$OUT/serve.log" ;;
  serve-capacity) shift
         python3 -c "import ray, ray.serve; print('ray', ray.__version__, 'with serve, from', ray.__file__)" || {
           echo "gpu.sh serve-capacity: Ray does not import here (build .whl/ with scripts/device_bundle.sh and carry it)" >&2
           exit 3; }
         python3 benchmarks/serve_capacity.py --json "$OUT/serve-capacity.json" "$@" 2>&1 | tee -a "$OUT/serve-capacity.log" ;;
  code2wav) shift; python3 benchmarks/code2wav.py --json "$OUT/code2wav.json" --rows "$OUT/code2wav-rows.jsonl" "$@" 2>&1 \
              | tee -a "$OUT/code2wav.log" ;;
  *) echo "usage: scripts/gpu.sh tests | cells CELL[,CELL...] | moshi [CELL,...] | cadence [benchmarks/cadence.py flags] | moshi-cadence [flags] | cold [flags] | code2wav [benchmarks/code2wav.py flags] | serve [benchmarks/serve_token2wav.py flags] | serve-capacity [benchmarks/serve_capacity.py flags]" >&2
     exit 2 ;;
esac
