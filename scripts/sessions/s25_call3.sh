# session 25, call 3: Qwen3-Omni's Code2Wav on the GPU (item 4): conversations per H200 at a streaming
# server's chunking (25 code frames = 2 s of audio per chunk, 24 frames of context, 2 s period), SRc on
# 8 lanes against stock processes (one conversation each) in the same run, every session SHA-256-gated
# against its script's solo stock run; then the 300-frame chunked_decode cells with branches (item 6)
export OUT=${OUT:-.out}; mkdir -p $OUT/c2w $OUT/c2wcells
export CADENCE_FX_UPSTREAM=$PWD/.upstream PYTHONPATH=$PWD
python3 -c "import transformers; print('transformers', transformers.__version__)"
OUT=$OUT/c2w timeout 400 bash scripts/gpu.sh cadence --model code2wav --cells SRc,stock --gpus 1 \
    --sessions 64,128,256,384 --stock-sessions 8,16 --lanes 8 --seconds 30 --warm-seconds 4 --scripts 4 \
    --time-budget 380 > /dev/null 2>&1
grep -v "chunks$\|_warn_once" $OUT/c2w/cadence.log | tail -12
OUT=$OUT/c2wcells timeout 170 bash scripts/gpu.sh code2wav --cells stock,cadence,cadenceb --chunks 10 > /dev/null 2>&1
grep -v "_warn_once" $OUT/c2wcells/code2wav.log | tail -8
