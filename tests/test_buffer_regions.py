"""Regions kept in module buffers (``Region(input=<buffer>, output=None)``): a model whose cache is a
buffer it writes in place is optimized and gets sessions with no wrapper, bit-exact, each session
with its own state; contracts that name the wrong buffer are refused by name."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import cadence_fx as cf

CAP, D = 8, 4


class KVCache(torch.nn.Module):
    """gpt-fast's pattern: a cache buffer written at the positions of this call."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("k_cache", torch.zeros(1, CAP, D))
        self.register_buffer("v_cache", torch.zeros(1, CAP, D))

    def update(self, pos, k, v):
        if self.how == "index_copy":
            self.k_cache.index_copy_(1, pos, k)
            self.v_cache.index_copy_(1, pos, v)
        else:  # slice assignment: k_out[:, input_pos] = k_val
            self.k_cache[:, pos] = k
            self.v_cache[:, pos] = v
        return self.k_cache, self.v_cache


class Decoder(torch.nn.Module):
    def __init__(self, how: str = "index_copy") -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.cache = KVCache(how)
        self.register_buffer("scale", torch.tensor(D ** -0.5))  # read, never written: not state

    def forward(self, x, pos):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keys, values = self.cache.update(pos, k, v)
        mask = torch.arange(CAP) <= pos.max()
        att = (q @ keys.transpose(1, 2) * self.scale).masked_fill(~mask, float("-inf")).softmax(-1)
        return att @ values


def _contract(**overrides):
    regions = tuple(cf.Region(n, input=f"cache.{n}_cache", output=None, clock="token", axis=1, order=None,
                              retention=cf.Ring(CAP), initial=CAP) for n in ("k", "v"))
    return cf.Contract(clocks=(cf.Clock("token", 1),), regions=regions, **overrides)


def _export(how="index_copy", decompose=False):
    torch.manual_seed(0)
    ep = torch.export.export(Decoder(how).eval(), (torch.randn(1, 1, D), torch.tensor([0])))
    return ep.run_decompositions() if decompose else ep


def _stream(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 1, D, generator=g), torch.tensor([k % CAP])) for k in range(n)]


@pytest.mark.parametrize("how,decompose", [("index_copy", False), ("index_copy", True), ("slice", False),
                                           ("slice", True)])
def test_buffer_cache_bit_exact_with_sessions(how, decompose):
    ep = _export(how, decompose)
    ref = copy.deepcopy(ep).module()
    prog = cf.optimize(ep, _contract())
    assert prog.input_names == ["x", "pos"]  # the caller's signature is the stock one
    a, b = prog.session(), prog.session()
    stream = _stream()
    want = [ref(*c).detach() for c in stream]
    got_default = [prog(*c) for c in stream]
    got_a = []
    for c in stream:
        got_a.append(a(*c))
        b(*_stream(1, seed=99)[0])  # another conversation between a's calls
    for w, d, s in zip(want, got_default, got_a):
        assert torch.equal(w, d) and torch.equal(w, s)
    assert prog.undeclared_state() == {}
    for row in cf.state_traffic(prog):
        for counts in row["regions"].values():
            assert counts["optimized"] <= counts["stock"]


def test_buffer_region_snapshot_restore():
    prog = cf.optimize(_export(), _contract())
    s = prog.session()
    stream = _stream(10)
    for c in stream[:5]:
        s(*c)
    snap = s.snapshot()
    first = [s(*c) for c in stream[5:]]
    s.restore(snap)
    again = [s(*c) for c in stream[5:]]
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    fresh = prog.session()  # a new conversation starts from the buffers' values at export
    ref = copy.deepcopy(_export()).module()
    for c in stream[:3]:
        assert torch.equal(fresh(*c), ref(*c).detach())


def test_failed_call_leaves_buffer_state():
    prog = cf.optimize(_export(), _contract())
    s = prog.session()
    stream = _stream(6)
    for c in stream[:3]:
        s(*c)
    before = s.snapshot()
    with pytest.raises(Exception):
        s(torch.randn(1, 1, D), torch.tensor([CAP + 5]))  # index out of range inside the call
    after = s.snapshot()
    assert all(torch.equal(before.state[n], after.state[n]) for n in before.state)


def test_wrong_buffer_named():
    ep = _export()
    bad = cf.Contract(clocks=(cf.Clock("token", 1),), regions=(
        cf.Region("s", input="scale", output=None, clock="token", axis=0, order=None, retention=cf.Ring(1),
                  initial=1),))
    with pytest.raises(cf.ContractError, match="never writes.*cache.k_cache"):
        cf.optimize(ep, bad)
    bad = cf.Contract(clocks=(cf.Clock("token", 1),), regions=(
        cf.Region("s", input="nope", output=None, clock="token", axis=0, order=None, retention=cf.Ring(1),
                  initial=1),))
    with pytest.raises(cf.ContractError, match="no buffer of the program"):
        cf.optimize(ep, bad)


def test_undeclared_buffer_still_refused_for_sessions():
    ep = _export()
    half = cf.Contract(clocks=(cf.Clock("token", 1),), regions=_contract().regions[:1])
    prog = cf.optimize(ep, half)
    with pytest.raises(cf.ContractError, match="v_cache"):
        prog.session()


def test_buffer_regions_survive_save_and_load(tmp_path):
    """An artifact stores where the buffer regions sit and their first values: the loaded program takes
    the stock signature, starts each conversation from the export's buffers, and streams the same bytes."""
    contract = dataclasses.replace(_contract(), wrap=(cf.WHOLE_STEP,))
    prog = cf.optimize(_export(), contract)
    info = cf.save(prog, tmp_path / "p.cfx")
    back = cf.load(tmp_path / "p.cfx", sha256=info["sha256"])
    assert back.input_names == ["x", "pos"]
    a, b = prog.session(), back.session()
    for c in _stream(12):
        assert torch.equal(a(*c), b(*c))


def test_tampered_buffer_region_entry_is_refused(tmp_path):
    import json

    prog = cf.optimize(_export(), dataclasses.replace(_contract(), wrap=(cf.WHOLE_STEP,)))
    path = tmp_path / "p.cfx"
    cf.save(prog, path)
    payload = torch.load(path, weights_only=True)
    manifest = json.loads(payload["manifest"])
    manifest["buffer_regions"]["inputs"]["k"] = 0  # claims the region sits at the first input ('x')
    payload["manifest"] = json.dumps(manifest)
    import hashlib
    payload["manifest_sha256"] = hashlib.sha256(payload["manifest"].encode()).hexdigest()
    torch.save(payload, path)
    with pytest.raises(cf.ArtifactError, match="buffer_regions"):
        cf.load(path)
