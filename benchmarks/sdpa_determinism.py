"""Is one attention call reproducible bit for bit, run after run, on this GPU? (A determinism probe.)

    python benchmarks/sdpa_determinism.py [--repeats 50]

The released Moshi temporal transformer's attention step: one query (bf16, 32 heads of 128) against a
3000-position ring with a boolean mask that admits the first ``n`` positions, as moshi 0.2.13 calls
``F.scaled_dot_product_attention`` per frame. For each ``n`` and each SDPA backend the call is repeated
with the same inputs and every output is compared bitwise with the first. Prints which backend the
default dispatch picks and, per backend and ``n``, how many repeats differed and the SHA-256 of the
first output (the inputs are seeded: two processes, or two GPUs, compare by these digests).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, cap, d = 1, 32, 3000, 128
    cache = torch.randn(2, b, h, cap, d, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, h, 1, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = cache[0], cache[1]
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "rows": []}
    for n in (1, 32, 64, 65, 100, 128, 129, 500, 2999):
        mask = (torch.arange(cap, device="cuda") < n).view(1, 1, 1, cap)
        choice = torch._fused_sdp_choice(q, k, v, mask)
        for backend in (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            try:
                ctx = sdpa_kernel([backend]) if backend is not None else torch.no_grad()
                with ctx, torch.no_grad():
                    first = F.scaled_dot_product_attention(q, k, v, mask)
                    differ = sum(not torch.equal(F.scaled_dot_product_attention(q, k, v, mask).view(torch.int16),
                                                 first.view(torch.int16)) for _ in range(args.repeats))
                sha = hashlib.sha256(first.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
            except RuntimeError as e:
                differ, sha = f"unavailable: {str(e).splitlines()[0][:80]}", None
            row = dict(n=n, backend=str(backend) if backend else f"default ({choice})", differ=differ, sha=sha)
            out["rows"].append(row)
            print(row, flush=True)
    # the same probe for the projections around it: a bf16 linear at batch 1
    x = torch.randn(1, 1, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    for nout in (4096, 12288, 11264, 32000):
        w = torch.randn(nout, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            first = F.linear(x, w)
            differ = sum(not torch.equal(F.linear(x, w), first) for _ in range(args.repeats))
        row = dict(op=f"linear 4096->{nout}", differ=differ)
        out["rows"].append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
