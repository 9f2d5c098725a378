#!/usr/bin/env bash
# Set up a virtual environment (once) and run the whole test suite.
#   bash scripts/test.sh [pytest args]
# Installs: torch (2.13.0 when none is present), this package with its test extras, and the two
# upstream releases of the Token2Wav decoder (minicpmo==0.1.2, minicpmo-utils==1.0.7). Both ship a
# package named `stepaudio2`, so each goes into its own folder under .upstream/ (no dependencies:
# the decoder needs only torch, einops and scipy; their __init__ pulls in ASR/onnx code we never run),
# and moshi==0.2.13 (the Moshi adapter) into .upstream/moshi-0.2.13, also without its dependencies: the
# wheel pins torch<2.10 and pulls audio I/O (sounddevice, sphn), aiohttp and bitsandbytes; the step
# imports only torch, einops and numpy (cadence_fx/adapters/moshi/upstream.py). transformers 5.x comes
# with the test extras (the corpus, tests/corpus/).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CADENCE_FX_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
py="$VENV/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e ".[test]"
UP=${CADENCE_FX_UPSTREAM:-.upstream}
for spec in "minicpmo==0.1.2:minicpmo-0.1.2" "minicpmo-utils==1.0.7:minicpmo-utils-1.0.7"; do
  req=${spec%%:*}; dir="$UP/${spec##*:}"
  if [ ! -d "$dir/stepaudio2" ]; then
    "$py" -m pip install -q --no-deps --target "$dir" "$req"
  fi
done
if [ ! -d "$UP/moshi-0.2.13/moshi" ]; then
  "$py" -m pip install -q --no-deps --target "$UP/moshi-0.2.13" "moshi==0.2.13"
fi
# torchaudio 2.9.1 for the corpus's Emformer and RNN-T: its wheel is built against torch 2.9 and its C
# extension does not load beside torch 2.13, so it goes into its own folder without dependencies and
# the corpus imports its pure-Python model files only (tests/corpus/_torchaudio.py)
if [ ! -d "$UP/torchaudio-2.9.1/torchaudio" ]; then
  "$py" -m pip install -q --no-deps --target "$UP/torchaudio-2.9.1" "torchaudio==2.9.1"
fi
# denoiser 0.1.5 (Demucs' streaming denoiser, the corpus's demucs_streamer) without its dependencies:
# they are for training and live audio (torchaudio pinned to an old torch, hydra, sounddevice);
# denoiser.demucs imports only torch
if ! "$py" -c "import denoiser.demucs" >/dev/null 2>&1; then
  "$py" -m pip install -q --no-deps "denoiser==0.1.5"
fi
export CADENCE_FX_UPSTREAM="$UP"
# two pytest-xdist workers (CADENCE_FX_TEST_WORKERS, 0 or 1: none), one unit (a module, a group or a
# test: tests/conftest.py's scheduler, which --dist loadgroup selects) per worker at a time, the longest
# units first
# on the 2-core CI machine the suite takes about half the time
workers=${CADENCE_FX_TEST_WORKERS:-2}
par=()
if [ "$workers" -gt 1 ]; then
  par=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec "$py" -m pytest -q "${par[@]}" "$@"
