"""A restarted controller adopting what its previous instance left (``cadence_fx.serve.adoption``), with
fake workers: which copy of a conversation is kept, what is thawed, what is checkpointed, and that a
conversation with no checkpoint is never rebuilt from a wrong base. The end-to-end restart (a real
controller killed mid-stream on a Ray cluster) is ``tests/test_serve_ray.py``'s."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.serve.conversation import ConversationState


def test_adoption_keeps_a_mid_move_conversations_newer_copy_thaws_a_lone_frozen_one_and_checkpoints_each(monkeypatch):
    """What a controller that died mid-move leaves: the conversation on both workers (the source frozen
    under epoch 1, the target under epoch 2): the target's copy is kept and the source's closed as
    moved; a conversation frozen alone (its move never reached a target) is thawed; every adopted one
    is checkpointed; one whose export fails is listed as unprotected; an unnamed actor is not adopted."""
    from types import SimpleNamespace

    import ray as ray_mod

    from cadence_fx.serve import adoption
    from cadence_fx.serve.controller import ServeController
    from cadence_fx.serve.conversation import NoWorkers

    calls = []

    class Ref:
        def __init__(self, value=None, error=None):
            self.value, self.error = value, error

    class Method:
        def __init__(self, worker, name, fn):
            self.worker, self.name, self.fn = worker, name, fn

        def remote(self, *args, **kwargs):
            calls.append((self.worker, self.name, args, kwargs))
            try:
                return Ref(self.fn(*args, **kwargs))
            except Exception as e:  # raised at ray.get, as Ray does
                return Ref(error=e)

    def worker(name, table, broken_export=()):
        status = SimpleNamespace(capacity=4, lanes=2, ready_s=1.0, calibration=SimpleNamespace(deadline_ms=1000.0))

        def export(cid):
            if cid in broken_export:
                raise ray_mod.exceptions.RayActorError()
            return ConversationState(cid, {}, torch.get_rng_state(), None, table[cid]["next_seq"], table[cid]["seed"])

        h = SimpleNamespace()
        for m, fn in (("status", lambda: status), ("conversation_table", lambda: table), ("close", lambda *a, **k: None),
                      ("thaw", lambda *a: None), ("export_conversation", export)):
            setattr(h, m, Method(name, m, fn))
        return h

    def facts(epoch, seq, frozen=False):
        return {"epoch": epoch, "next_seq": seq, "seed": 5, "frozen": frozen, "routed": True}

    handles = {"ctl.w0": worker("w0", {"moving": facts(1, 9, frozen=True), "lone": facts(3, 4, frozen=True)}),
               "ctl.w1": worker("w1", {"moving": facts(2, 9), "broken": facts(0, 2)}, broken_export=("broken",)),
               "other.w9": worker("w9", {"x": facts(0, 1)})}

    def get(refs, timeout=None):
        many = isinstance(refs, list)
        out = []
        for r in refs if many else [refs]:
            if r.error is not None:
                raise r.error
            out.append(r.value)
        return out if many else out[0]

    monkeypatch.setattr(ray_mod.util, "list_named_actors", lambda: sorted(handles))
    monkeypatch.setattr(ray_mod, "get_actor", lambda name: handles[name])
    monkeypatch.setattr(ray_mod, "get", get)
    monkeypatch.setattr(adoption, "put_checkpoint", lambda state: ("ref", state.conv_id))
    ctl = ServeController.__new__(ServeController)
    ServeController.__init__(ctl)  # not restartable: nothing adopted
    assert ctl.adopted == {} and ctl._workers == {}
    ctl._adopt("ctl")
    assert sorted(ctl._workers) == ["w0", "w1"]  # not "other.w9"
    assert {c: (v.worker, v.epoch, v.next_seq) for c, v in ctl._convs.items()} == {
        "moving": ("w1", 2, 9), "lone": ("w0", 3, 4), "broken": ("w1", 0, 2)}
    assert ("w0", "close", ("moving",), {"moved": True}) in calls  # the move's source: closed as moved
    assert ("w0", "thaw", ("lone",), {}) in calls and not any(c[1] == "thaw" and c[0] == "w1" for c in calls)
    assert ctl.adopted["checkpointed"] == 2 and ctl.adopted["unprotected"] == ["broken"]
    assert ctl._convs["moving"].journal.base.state == ("ref", "moving")
    # the one with no checkpoint is never rebuilt from a wrong base
    import asyncio

    from cadence_fx.serve.checkpoints import resume

    with pytest.raises(NoWorkers, match="'broken' has no checkpoint to resume from"):
        asyncio.run(resume("broken", ctl._convs["broken"].journal, None, "w2", overcommit=False))
