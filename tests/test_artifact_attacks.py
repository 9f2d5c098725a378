"""A hostile artifact: ``cf.load`` treats the file as data.

Each attack edits a saved demo artifact the way an attacker would: load the payload with
``torch.load(weights_only=True)``, edit the manifest JSON, recompute its SHA-256 (it is stored in the
same file) and save it back. Loading it, or its first call, must raise ``cf.ArtifactError``, and the
marker file the injected code would create must not exist. ``cf.save`` writes through no planted
link, and ``load(path, sha256=...)`` pins the file: a retargeted operator with recomputed digests is
data, so it loads, and only the pin refuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import cadence_fx as cf
from cadence_fx import artifact
from tests.test_artifact import _inputs, demo  # noqa: F401 - demo: the saved demo artifact (a fixture)


def _example(model):
    tok, noise = _inputs(0, 0)
    return tok, *model.initial_state(), noise


def _tampered(src: Path, dst: Path, edit) -> Path:
    """``src`` with ``edit(manifest, payload)`` applied and the manifest's SHA-256 recomputed."""
    payload = torch.load(src, weights_only=True)
    manifest = json.loads(payload["manifest"])
    text = edit(manifest, payload)  # an edit may return the manifest's text itself (JSON json.dumps cannot write)
    text = text if isinstance(text, str) else json.dumps(manifest)
    payload["manifest"], payload["manifest_sha256"] = text, hashlib.sha256(text.encode()).hexdigest()
    torch.save(payload, dst)
    return dst


def _module(manifest, path: str = "", program: int = 0):
    return next(m for m in manifest["programs"][program]["modules"] if m["path"] == path)


def _nodes(manifest, path: str = "", program: int = 0) -> list:
    return _module(manifest, path, program)["graph"]["nodes"]


def _insert(manifest, node, path: str = "submod_0") -> None:
    """``node`` before the output of every program's module ``path``."""
    for i in range(len(manifest["programs"])):
        nodes = _nodes(manifest, path, i)
        nodes.insert(len(nodes) - 1, node)


def _code(marker: Path) -> str:
    """A Python expression that creates ``marker``, written without dots or quotes (which a pasted
    attribute path could not hold)."""
    return "exec(" + "+".join(f"chr({ord(c)})" for c in f"open({str(marker)!r}, 'w').close()") + ")"


def _refused(path: Path, model, marker: Path, *, match: str | None = None, **kw) -> None:
    """Loading ``path``, or the loaded program's first call, raises ArtifactError; ``marker`` is not made."""
    with pytest.raises(cf.ArtifactError, match=match):
        prog = cf.load(path, replay="off", **kw)
        prog(*_example(model))
    assert not marker.exists(), "code from the artifact ran"


# --------------------------------------------------------------------------- code in names and targets
def _name(manifest, marker):  # a node name pasted as an assignment target / a default argument
    _nodes(manifest, "submod_0")[-2][1] = f"linear = {_code(marker)}\n    linear"


def _placeholder(manifest, marker):  # def forward(self, ..., tokens=<code>): runs when the code is compiled
    node = next(n for n in _nodes(manifest, "submod_0") if n[0] == "placeholder")
    node[2] = f"tokens={_code(marker)}"


def _escape(target: str, marker: Path, base: str = "self") -> str:
    """A path element torch.fx writes as ``getattr(<base>, "<element>")``, closing the quote."""
    return f'{target}"), {_code(marker)}, getattr({base}, "{target}'


def _get_attr(manifest, marker):
    node = next(n for n in _nodes(manifest, "submod_0") if n[0] == "get_attr")
    node[2] = _escape(node[2], marker)


def _call_module(manifest, marker):
    node = next(n for n in _nodes(manifest) if n[0] == "call_module")
    node[2] = _escape(node[2], marker)


def _call_method(manifest, marker):
    _insert(manifest, ["call_method", "evil", _escape("add", marker, "tokens"), ["%tokens", 1], {}, {}])


def _call_method_system(manifest, marker):
    _insert(manifest, ["call_method", "evil", "system", ["%tokens", f"touch {marker}"], {}, {}])


def _keyword(manifest, marker):  # keyword names are pasted as f"{k} = {v}"
    node = next(n for n in _nodes(manifest, "submod_0") if n[0] == "call_function")
    node[4] = {f"x = {_code(marker)}, y": 1}


def _pytree_args(manifest, marker):  # the root's signature is its orig_args
    _module(manifest)["graph"]["pytree"]["orig_args"][-1] = f"noise={_code(marker)}"


def _pytree_dict_key(manifest, marker):  # the last input as a keyword: its key is pasted as f"'{k}':{v}"
    pytree = _module(manifest)["graph"]["pytree"]
    spec = json.loads(pytree["in_spec"])
    args, kwargs = spec[1]["children_spec"]
    kwargs["children_spec"] = [args["children_spec"].pop()]
    kwargs["context"] = json.dumps([f"noise':noise, 'x':{_code(marker)}, 'y"])
    pytree["in_spec"] = json.dumps(spec)


@pytest.mark.parametrize("edit", [_name, _placeholder, _get_attr, _call_module, _call_method, _call_method_system,
                                  _keyword, _pytree_args, _pytree_dict_key], ids=lambda f: f.__name__.strip("_"))
def test_code_in_a_name_or_target_is_refused(demo, tmp_path, edit):
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"
    bad = _tampered(path, tmp_path / "bad.cfx", lambda m, _p: edit(m, marker))
    _refused(bad, model, marker)


def test_code_is_refused_before_the_digests_and_without_them(demo, tmp_path):
    """The graphs are checked before torch.fx generates any code: a file that also carries a wrong
    tensor digest, loaded with or without the digest check, runs nothing."""
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"

    def edit(m, payload):
        _placeholder(m, marker)
        payload["tensors"][0].view(-1)[0] += 1

    bad = _tampered(path, tmp_path / "bad.cfx", edit)
    for check in (True, False):
        _refused(bad, model, marker, match="placeholder target", check_weights=check)


# --------------------------------------------------------------------------- call targets
def _call(fn: str, qualname: str, *args):
    node = ["call_function", "evil", {"fn": fn, "qualname": qualname}, list(args), {}, {}]
    return lambda m, _marker: _insert(m, node)


CALLS = {
    "builtins.exec": lambda marker: _call("builtins", "exec", f"open({str(marker)!r}, 'w').close()"),
    "builtins.eval": lambda marker: _call("builtins", "eval", f"open({str(marker)!r}, 'w').close()"),
    "builtins.open": lambda marker: _call("builtins", "open", str(marker), "w"),
    "builtins.__import__": lambda marker: _call("builtins", "__import__", "os"),
    "operator.methodcaller": lambda marker: _call("operator", "methodcaller", "system", f"touch {marker}"),
    "torch.serialization.os.system": lambda marker: _call("torch.serialization", "os.system", f"touch {marker}"),
    "cadence_fx.artifact.os.system": lambda marker: _call("cadence_fx.artifact", "os.system", f"touch {marker}"),
    "torch.ops.aten.from_file": lambda marker: lambda m, _mk: _insert(
        m, ["call_function", "evil", {"op": "aten::from_file", "overload": "default"}, [str(marker), True, 8], {}, {}]),
    "torch.ops.aten.save": lambda marker: lambda m, _mk: _insert(
        m, ["call_function", "evil", {"op": "aten::save", "overload": "default"}, ["%tokens", str(marker)], {}, {}]),
    "torch.ops.profiler": lambda marker: lambda m, _mk: _insert(
        m, ["call_function", "evil", {"op": "profiler::_record_function_enter", "overload": "default"}, ["x"], {}, {}]),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_outside_the_tables_is_refused(demo, tmp_path, name):
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"
    edit = CALLS[name](marker)
    bad = _tampered(path, tmp_path / "bad.cfx", lambda m, _p: edit(m, marker))
    _refused(bad, model, marker, match="evil")  # the message names the node


def test_no_module_is_imported_by_name(demo, tmp_path, monkeypatch):
    """Neither a call target's module nor a pytree spec's enum (torch's spec loader imports the
    module an enum names) is imported: a module on sys.path that would create the marker stays
    unimported."""
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"
    (tmp_path / "cf_attack_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport enum\n"
                                                  f"class E(enum.Enum):\n    A = 1\ndef f(*a):\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_call = _tampered(path, tmp_path / "call.cfx", lambda m, _p: _call("cf_attack_module", "f")(m, marker))

    def enum_spec(m, _p):
        pytree = _module(m)["graph"]["pytree"]
        spec = json.loads(pytree["in_spec"])
        member = {"__enum__": True, "fqn": "cf_attack_module:E", "name": "A"}
        spec[1]["children_spec"][1] = {"type": "builtins.dict", "context": json.dumps([member]),
                                       "children_spec": [{"type": None, "context": None, "children_spec": []}]}
        pytree["in_spec"] = json.dumps(spec)

    by_spec = _tampered(path, tmp_path / "spec.cfx", enum_spec)
    for bad in (by_call, by_spec):
        _refused(bad, model, marker)
    assert "cf_attack_module" not in sys.modules


def test_an_annotation_outside_the_known_kinds_is_refused(demo, tmp_path):
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"
    annotated = next(n for n in _nodes(json.loads(torch.load(path, weights_only=True)["manifest"])) if n[5])
    for key, value in (("cadence_wrapped", {"list": ["x"]}), ("cadence_segment", True), ("cadence_other", 1),
                       ("cadence_replay", {"ReplaySpec": {"name": "x", "aliased": ["0"], "readonly": [],
                                                          "written": None}})):
        def edit(m, _p, key=key, value=value):
            next(n for n in _nodes(m) if n[1] == annotated[1])[5][key] = value

        _refused(_tampered(path, tmp_path / "bad.cfx", edit), model, marker, match="annotation|integers")


def test_an_attribute_the_module_tree_does_not_hold_is_refused(demo, tmp_path):
    """get_attr / call_module targets resolve against the stored module tree, and an attribute never
    replaces one of the module's own (forward)."""
    model, _contract, _eps, _prog, path, _info = demo
    marker = tmp_path / "pwned"
    edits = {
        "get_attr": lambda m, _p: next(n for n in _nodes(m) if n[0] == "get_attr").__setitem__(2, "training"),
        "call_module": lambda m, _p: next(n for n in _nodes(m) if n[0] == "call_module").__setitem__(2, "embed.weight"),
        "forward": lambda m, _p: _module(m)["attrs"][0].__setitem__(slice(0, 2), ["forward", "attribute"]),
        "buffer": lambda m, _p: _module(m)["attrs"][0].__setitem__(0, "forward"),
    }
    for name, edit in edits.items():
        _refused(_tampered(path, tmp_path / f"{name}.cfx", edit), model, marker,
                 match="module tree|module's own|already exists")


# --------------------------------------------------------------------------- sizes and depths
def _workspace(shape):
    def edit(m, payload):
        m["workspaces"].append({"shape": shape, "dtype": "float32", "zero": True, "sha256": None})
        payload["workspaces"].append(None)
        _module(m, "submod_0")["attrs"][-1][2] = ["workspace", len(m["workspaces"]) - 1]
    return edit


@pytest.mark.parametrize("shape", [[2 ** 50], [2 ** 20, 2 ** 20], [-1], ["8"], [1.5]], ids=str)
def test_a_workspace_beyond_the_bound_is_refused(demo, tmp_path, shape):
    model, _contract, _eps, _prog, path, _info = demo
    bad = _tampered(path, tmp_path / "bad.cfx", lambda m, p: _workspace(shape)(m, p))
    _refused(bad, model, tmp_path / "none", match="allocate|shape")


def test_a_region_or_input_beyond_the_bound_is_refused(demo, tmp_path):
    model, _contract, _eps, _prog, path, _info = demo

    def region(m, _p):
        r = dict(m["plan"]["regions"][0]["dict"])
        r["stored_shape"] = [2 ** 40, 32]
        m["plan"]["regions"][0]["dict"] = [[k, v] for k, v in r.items()]

    def key(m, _p):
        m["programs"][0]["key"][0][1] = [2 ** 45]

    for name, edit in (("region", region), ("key", key)):
        _refused(_tampered(path, tmp_path / f"{name}.cfx", edit), model, tmp_path / "none", match="allocate")


def test_a_stored_view_beyond_the_bound_is_refused(demo, tmp_path):
    """A stored tensor whose view spans far more than its storage (stride 0): digesting it would copy it."""
    model, _contract, _eps, _prog, path, _info = demo

    def edit(_m, payload):
        payload["tensors"][0] = torch.zeros(1).expand(2 ** 40)

    _refused(_tampered(path, tmp_path / "bad.cfx", edit), model, tmp_path / "none", match="allocate")


def test_deep_nesting_is_refused(demo, tmp_path):
    model, _contract, _eps, _prog, path, _info = demo
    for depth in (5000, 100):  # past json's own recursion limit, and past the decoder's bound
        def edit(m, _p, depth=depth):
            _nodes(m, "submod_0")[-2][3] = "DEEP"
            return json.dumps(m).replace('"DEEP"', "[" * depth + "]" * depth)

        _refused(_tampered(path, tmp_path / f"deep{depth}.cfx", edit), model, tmp_path / "none",
                 match="nested|JSON|Recursion")


# --------------------------------------------------------------------------- malformed payloads
def test_every_malformed_payload_is_an_artifact_error(demo, tmp_path):
    model, _contract, _eps, _prog, path, _info = demo

    def tensor_is_a_string(_m, payload):
        payload["tensors"][0] = "not a tensor"

    def payload_key_missing(_m, payload):
        del payload["workspaces"]

    def manifest_key_missing(m, _p):
        del m["plan"]

    def program_key_missing(m, _p):
        del m["programs"][0]["modules"][0]["attrs"]

    def node_key_missing(m, _p):
        _nodes(m, "submod_0")[-2].pop()

    def wrong_length(_m, payload):
        payload["tensors"].pop()

    def wrong_type(m, _p):
        m["programs"][0]["sites"] = ["encoder_kv"]

    def bad_index(m, _p):
        _module(m, "submod_0")["attrs"][0][2] = ["tensor", -1]

    def bad_json(_m, _p):
        return '{"version": 1, "programs": [}'

    def not_an_object(_m, _p):
        return "[1, 2]"

    for edit in (tensor_is_a_string, payload_key_missing, manifest_key_missing, program_key_missing,
                 node_key_missing, wrong_length, wrong_type, bad_index, bad_json, not_an_object):
        bad = _tampered(path, tmp_path / f"{edit.__name__}.cfx", edit)
        with pytest.raises(cf.ArtifactError, match="cadence_fx.load"):
            cf.load(bad, replay="off")
    with pytest.raises(FileNotFoundError):
        cf.load(tmp_path / "missing.cfx")


# --------------------------------------------------------------------------- pinning, and what digests are for
def test_save_returns_and_logs_the_file_sha256_and_load_pins_it(demo, tmp_path, caplog):
    _model, _contract, _eps, prog, path, info = demo
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    with caplog.at_level(logging.INFO, logger="cadence_fx"):
        again = cf.save(prog, tmp_path / "again.cfx")
    assert any(again["sha256"] in r.getMessage() for r in caplog.records)
    assert isinstance(cf.load(path, replay="off", sha256=info["sha256"]), cf.OptimizedProgram)
    with pytest.raises(cf.ArtifactError, match="pinned"):
        cf.load(path, replay="off", sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        cf.load(path, replay="off", sha256="not a digest")


def test_a_retargeted_operator_with_recomputed_digests_is_data_and_only_the_pin_catches_it(demo, tmp_path):
    """``add`` -> ``sub`` with every digest recomputed: a well-formed artifact, so it loads and
    computes what its author chose, like an edited checkpoint (its digests catch accidents, not
    attacks); pinning the SHA-256 :func:`cf.save` returned refuses it."""
    model, _contract, _eps, prog, path, info = demo

    def edit(m, _p):
        hits = [n for p in m["programs"] for mod in p["modules"] for n in mod.get("graph", {}).get("nodes", ())
                if n[2] == {"op": "aten::add", "overload": "Tensor"}]
        assert hits
        for n in hits:
            n[2] = {"op": "aten::sub", "overload": "Tensor"}

    bad = _tampered(path, tmp_path / "sub.cfx", edit)
    example = _example(model)
    altered = cf.load(bad, replay="off")  # data: it loads
    assert not all(torch.equal(a, b) for a, b in zip(altered(*example), prog(*_example(model))))
    with pytest.raises(cf.ArtifactError, match="pinned"):
        cf.load(bad, replay="off", sha256=info["sha256"])


# --------------------------------------------------------------------------- writing
def test_save_writes_through_no_planted_link(demo, tmp_path):
    """A link at the old predictable temporary name, and one at the target itself: save replaces
    the target's name and leaves both links' targets as they were."""
    _model, _contract, _eps, prog, _path, _info = demo
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out.cfx"
    os.symlink(victim, tmp_path / "out.cfx.partial")
    cf.save(prog, out)
    assert victim.read_bytes() == b"precious" and os.readlink(tmp_path / "out.cfx.partial") == str(victim)
    linked = tmp_path / "linked.cfx"
    os.symlink(victim, linked)
    info = cf.save(prog, linked)
    assert victim.read_bytes() == b"precious"
    assert not linked.is_symlink() and hashlib.sha256(linked.read_bytes()).hexdigest() == info["sha256"]
    assert isinstance(cf.load(linked, replay="off", sha256=info["sha256"]), cf.OptimizedProgram)
    assert oct(linked.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_failed_save_leaves_no_file(demo, tmp_path, monkeypatch):
    _model, _contract, _eps, prog, _path, _info = demo

    def broken(obj, f, *a, **k):
        f.write(b"half an artifact")
        raise OSError("disk full")

    monkeypatch.setattr(artifact.torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        cf.save(prog, tmp_path / "failed.cfx")
    assert list(tmp_path.iterdir()) == []


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
