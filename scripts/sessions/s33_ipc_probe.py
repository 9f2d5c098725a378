"""Session 33, call 3: does a fourth MPS client fail to create its context once two clients hold CUDA
IPC mappings of a third's large allocation (session 33 call 1's failure, with the GPU 71 % free)?
Run under an MPS daemon: `python3 scripts/sessions/s33_ipc_probe.py GIB` prints one line per client."""
import sys
import time

import torch
import torch.multiprocessing as mp


def consumer(q, done, i):
    t = q.get()  # maps the producer's allocation (CUDA IPC)
    print(f"consumer {i} mapped {t.numel() * t.element_size() / 2**30:.1f} GiB, first {float(t[0])}", flush=True)
    done.put(i)
    time.sleep(30)


def late(done, tag):
    try:
        x = torch.empty(1 << 28, device="cuda")
        torch.cuda.synchronize()
        print(f"{tag}: context and 1 GiB ok ({torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free)", flush=True)
    except Exception as e:  # noqa: BLE001 -- the probe reports whatever fails
        print(f"{tag}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    done.put(tag)
    time.sleep(5)


if __name__ == "__main__":
    mp.set_start_method("spawn")
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 14.7
    early_done = mp.Queue()
    early = mp.Process(target=late, args=(early_done, "fourth client created before any mapping"))
    early.start()
    early_done.get()
    w = torch.ones(int(gib * 2**30 / 2), dtype=torch.bfloat16, device="cuda")
    q, done = mp.Queue(), mp.Queue()
    cs = [mp.Process(target=consumer, args=(q, done, i)) for i in (1, 2)]
    for c in cs:
        c.start()
        q.put(w)
    for _ in cs:
        done.get()
    p = mp.Process(target=late, args=(done, "fourth client created after two mappings"))
    p.start()
    done.get()
    print("nvidia: producer", torch.cuda.mem_get_info()[0] / 2**30, "GiB free", flush=True)
    for c in cs + [p, early]:
        c.terminate()
