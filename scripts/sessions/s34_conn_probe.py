"""Session 34, call 1: how many MPS clients start for each CUDA_DEVICE_MAX_CONNECTIONS?

NVIDIA's MPS docs: under Volta MPS a client owns the connections (work queues) it asks for, out of one
pool shared by the server's clients, so a large CUDA_DEVICE_MAX_CONNECTIONS "may reduce the number of
available clients". The cadence workers ask for 32 each (`--cuda-connections`), and a fourth Moshi
worker never started (sessions 32-33, `cudaErrorMemoryAllocation` at its first allocation, GPU 71 %
free); a bare fourth client without the variable started (session 33 calls 2-3). This probe starts
clients one after another under the benchmark's own daemon (`benchmarks/cadence_mps.MpsDaemon`), each
with the given connections, a context, 1 GiB and 8 streams, and keeps them alive until one fails or
`MAX` are up. Prints one line per client and a summary per setting.
`python3 scripts/sessions/s34_conn_probe.py [32,16,8] [MAX]`
"""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())
from benchmarks.cadence_mps import MpsDaemon  # noqa: E402

CLIENT = r"""
import sys, torch
try:
    x = torch.empty(1 << 28, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(8)]
    for s in streams:
        with torch.cuda.stream(s):
            x[:1024].add_(1)
    torch.cuda.synchronize()
    print("ok", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, str(e).splitlines()[0], flush=True)
    sys.exit(1)
sys.stdin.read()  # held until the probe closes stdin
"""


def trial(daemon: MpsDaemon, connections: int, most: int) -> int:
    env = daemon.env(dict(os.environ))
    if connections:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)
    else:
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    procs, up = [], 0
    for i in range(most):
        p = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(p)
        line = p.stdout.readline().strip()
        print(f"  connections {connections or 'unset'}: client {i}: {line or '(no output, rc %s)' % p.poll()}",
              flush=True)
        if not line.startswith("ok"):
            break
        up += 1
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
        p.wait(timeout=30)
    time.sleep(2)  # the server releases the clients' connections
    print(f"connections {connections or 'unset'}: {up} clients up (of {most} tried)", flush=True)
    return up


if __name__ == "__main__":
    settings = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "32,16,8").split(",")]
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    daemon = MpsDaemon()
    if not daemon.start(gpus_visible=True):
        print("no MPS daemon:", daemon.facts)
        sys.exit(1)
    try:
        for c in settings:
            trial(daemon, c, most)
    finally:
        daemon.stop()
