"""Session 28: which attention op does an export on this GPU hold, per dtype, and does ``draws`` call it a
draw? (float16 Token2Wav's flow estimator was counted ``declared`` drawing, fp32's not.)

    PYTHONPATH=. python scripts/sessions/s28_sdpa_export.py
"""
import torch
import torch.nn.functional as F

from cadence_fx.analysis.ops import draws, is_random


class Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


for dtype in (torch.float32, torch.float16):
    for masked in (False, True):
        q = torch.randn(2, 8, 50, 64, device="cuda", dtype=dtype)
        mask = torch.ones(2, 1, 50, 50, device="cuda", dtype=torch.bool) if masked else None
        with torch.no_grad():
            plain = torch.export.export(Attend().eval(), (q, q, q, mask))
        for how, ep in (("export", plain), ("run_decompositions", plain.run_decompositions({}))):
            seeded = [(str(n.target), draws(n)) for n in ep.graph.nodes if n.op == "call_function" and is_random(n)]
            print(dtype, "mask" if masked else "no mask", how, "seeded ops (op, draws):", seeded or "none")
        gen = torch.cuda.default_generators[0]
        before = gen.get_offset()
        ep.module()(q, q, q, mask)
        torch.cuda.synchronize()
        print("   generator offset moved:", gen.get_offset() != before)
