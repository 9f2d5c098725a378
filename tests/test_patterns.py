"""Ordinary streaming patterns no pass can rewrite in place bind anyway: each region is owned by the
program (a stable buffer, sessions, snapshots), costs one copy into its buffer with a structured reason,
and every output stays bit-exact. Contradictions are refused naming the program's class; data-dependent
sizes are never a raw torch exception."""

from __future__ import annotations

import copy

import pytest
import torch

import cadence_fx as cf

W, N, C = 6, 4, 3


class Middle(torch.nn.Module):
    """The cache as the middle operand of a cat: ``cat([key[:, :1], cache, key[:, 1:]])``."""

    def forward(self, key, cache):
        full = torch.cat([key[:, :1], cache, key[:, 1:]], 1)
        return full.sum(1) * 2, full[:, -W:]


class TailOfNew(torch.nn.Module):
    """A causal conv's padding cache once the chunk is longer than the kernel: ``next = x[..., -k:]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(C, C, 3)

    def forward(self, x, ctx):
        return self.conv(torch.cat([ctx, x], -1)), x[..., -2:]


class PadThenCat(torch.nn.Module):
    """The cache reaches its cat through a pad (torchaudio's Emformer keeps fixed-size padded caches)."""

    def forward(self, x, cache):
        padded = torch.nn.functional.pad(cache, (0, 1))[..., :-1]  # padded on the channels, cut back
        full = torch.cat([padded, x], 1)
        return full.sum(1), full[:, -W:]


class DataDependent(torch.nn.Module):
    """A size from a tensor value (``.item()``: an unbacked symbol in the exported program)."""

    def forward(self, x, cache, n):
        k = n.item()
        torch._check_is_size(k)
        torch._check(k <= N)
        part = torch.cat([cache, x[:, :k]], 1)
        full = torch.cat([cache, x], 1)
        return part.sum(1) + full.sum(1), full[:, -W:]


def _contract(model, input_name="cache", axis=1, retention=cf.SlidingWindow(W), initial=0, order="old_new"):
    return cf.Contract(clocks=(cf.Clock("f", N),), wrap=(cf.WHOLE_STEP,), regions=(
        cf.Region("s", input=input_name, output=1, clock="f", axis=axis, order=order, retention=retention,
                  initial=initial),))


CASES = {
    "middle": (Middle, _contract(Middle), {"key": (1, N, C), "cache": (1, 0, C)}, "cat_not_append"),
    "tail": (TailOfNew, _contract(TailOfNew, "ctx", 2, cf.Ring(2), 2), {"x": (1, C, N), "ctx": (1, C, 2)},
             "state_replaced"),
    "pad": (PadThenCat, _contract(PadThenCat, retention=cf.SlidingWindow(W), initial=0),
            {"x": (1, N, C), "cache": (1, 0, C)}, "cat_not_append"),
    "item": (DataDependent, _contract(DataDependent), {"x": (1, N, C), "cache": (1, 0, C), "n": None}, None),
}


def _example(shapes):
    return {k: torch.tensor(2) if v is None else torch.zeros(v) for k, v in shapes.items()}


def _stream(prog, names, example, k, state, g):
    args = []
    for n in names:
        v = example[n]
        args.append(state if n in ("cache", "ctx") else torch.tensor(2) if v.dim() == 0 else
                    torch.randn(v.shape, generator=g))
    return prog(*args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pattern_binds_exact_with_a_reason(name):
    cls, contract, shapes, finding = CASES[name]
    torch.manual_seed(0)
    example = _example(shapes)
    eps = cf.export_catalog(cls().eval(), contract, example)
    prog = cf.optimize(eps, contract, replay="off")
    ref = cf.reference(copy.deepcopy(eps))
    names = list(example)
    init = example[contract.regions[0].input].clone()
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    s_ref, s_opt = init.clone(), init.clone()
    session, s_ses = prog.session(), init.clone()
    g3 = torch.Generator().manual_seed(1)
    for k in range(12):
        a = _stream(ref, names, example, k, s_ref, g1)
        b = _stream(prog, names, example, k, s_opt, g2)
        c = _stream(session, names, example, k, s_ses, g3)
        assert all(torch.equal(u, v) and torch.equal(u, w) for u, v, w in zip(a, b, c)), k
        s_ref, s_opt, s_ses = a[1], b[1], c[1]
        assert s_opt.data_ptr() == prog.region_pointer("s")
    kinds = {f.pattern for row in cf.state_traffic(prog) for f in row["left_stock"]}
    if finding is not None:
        assert finding in kinds
    for row in cf.state_traffic(prog):  # every count known, and any excess over stock reported
        counts = row["regions"]["s"]
        assert counts["stock"] is not None and counts["optimized"] is not None
        above = any(f.pattern == "traffic_above_stock" for f in row["left_stock"])
        assert above == (counts["optimized"] > counts["stock"]), row


def test_a_contradiction_names_the_class():
    contract = _contract(Middle, retention=cf.SlidingWindow(W), initial=0)
    eps = cf.export_catalog(Middle().eval(), contract, _example(CASES["middle"][2]))
    bad = _contract(Middle, retention=cf.HeadTail(2, 4), initial=0)  # keeps other positions than the graph
    with pytest.raises(cf.ContractError, match=r"exported program \d+ \(class s=\d+\): Region 's'"):
        cf.optimize(eps, bad, replay="off")


def test_a_wrong_axis_is_still_refused():
    contract = _contract(TailOfNew, "ctx", 1, cf.Ring(C), C)  # axis 1 is the channels: the cat is on 2
    example = {"x": torch.zeros(1, C, N), "ctx": torch.zeros(1, C, 2)}
    eps = [torch.export.export(TailOfNew().eval(), tuple(example.values()))]
    with pytest.raises(cf.ContractError, match="along axis 2"):
        cf.optimize(eps, contract, replay="off")


def test_a_state_fed_to_the_other_region_is_staged():
    """Two regions, each fed the other's returned state: adopting one must not clobber the other."""

    class Two(torch.nn.Module):
        def forward(self, x, a, b):
            fa, fb = torch.cat([a, x], 1), torch.cat([b, 2 * x], 1)
            return fa.sum(1) + fb.sum(1), fa[:, -W:], fb[:, -W:]

    regions = tuple(cf.Region(n, input=n, output=i + 1, clock="f", axis=1, order="old_new",
                              retention=cf.Ring(W), initial=W) for i, n in enumerate("ab"))
    contract = cf.Contract(clocks=(cf.Clock("f", N),), regions=regions, wrap=(cf.WHOLE_STEP,))
    ex = {"x": torch.zeros(1, N, C), "a": torch.zeros(1, W, C), "b": torch.zeros(1, W, C)}
    eps = [torch.export.export(Two().eval(), tuple(ex.values()))]
    prog, ref = cf.optimize(eps, contract, replay="off"), cf.reference(copy.deepcopy(eps))
    g = torch.Generator().manual_seed(0)
    ra, rb = torch.randn(1, W, C, generator=g), torch.randn(1, W, C, generator=g)
    oa, ob = ra.clone(), rb.clone()
    for k in range(6):
        x = torch.randn(1, N, C, generator=g)
        r, o = ref(x, ra, rb), prog(x, oa, ob)
        assert all(torch.equal(u, v) for u, v in zip(r, o)), k
        ra, rb, oa, ob = r[2], r[1], o[2], o[1]  # swapped on purpose: a's state fed as b and back
