"""Conversations served across Ray workers: placement, affinity, admission, migration, drain,
rebalance, failover. Every conversation's stream is checked bit for bit (SHA-256 over the whole stream)
against the same conversation run alone through the unmodified exported programs (``cf.reference``).

One local Ray cluster for the module (three nodes of one CPU each: the object store moves state
between nodes as between machines), one demo artifact saved once, workers loaded from it with one lane
and replay off (the CPU). Workers are killed with ``ray.kill`` and with ``SIGKILL`` of their process
while chunks of several conversations are in flight. Chunks go through the controller (two hops) or
through a :class:`Router` in this process (one hop, the journal here). The reduced Token2Wav (its
saved artifact, shared with the artifact tests) is served by two more workers through a router.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

import cadence_fx as cf  # noqa: E402
from cadence_fx.serve import wire  # noqa: E402
from cadence_fx.serve.cluster import system_config  # noqa: E402
from cadence_fx.serve.checkpoints import CheckpointPolicy  # noqa: E402
from cadence_fx.serve.controller import ControllerConfig, start_controller  # noqa: E402
from cadence_fx.serve.conversation import (AdmissionRefused, ConversationClosed, Fenced,  # noqa: E402
                                           NoWorkers, SequenceError, UnknownConversation)
from cadence_fx.serve.placement import WorkerView, choose, rebalance_moves  # noqa: E402
from cadence_fx.serve.router import Router  # noqa: E402
from cadence_fx.serve.worker import ConversationWorker, WorkerConfig, share_artifact  # noqa: E402
from cadence_fx.testing.demo_model import DemoConfig  # noqa: E402
from tests.helpers import demo_catalog, demo_inputs, sha256  # noqa: E402

CFG = DemoConfig()
K = 4  # checkpoint every K chunks in this module
CAPACITY = 3
OPTIONS = {"num_cpus": 0.5, "scheduling_strategy": "SPREAD"}
HEALTH_TIMEOUT = 2.0  # a ping slower than this is a dead worker


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting; also keeps the reference runs quick on 2 cores
    model, contract, eps = demo_catalog(CFG)
    prog = cf.optimize(eps, contract, replay="off")
    path = tmp_path_factory.mktemp("serve") / "demo.cfx"
    info = cf.save(prog, path)
    yield model, eps, str(path), info["sha256"]
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster():
    # local_fs_capacity_threshold: an object the 100 MiB store cannot hold goes to a file beside it,
    # which Ray refuses once the disk is 95 % used; CI's disk is shared and reads fuller than that
    # (its free space against the whole volume), so the check is off for this test cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                      "_system_config": system_config(local_fs_capacity_threshold=1.0),
                                                      "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=100 << 20)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    wire.install()
    yield c
    ray.shutdown()
    c.shutdown()


def worker_config(demo, **kw) -> WorkerConfig:
    _model, _eps, path, digest = demo
    base = dict(artifact=path, sha256=digest, lanes=1, replay="off", capacity=CAPACITY, threads=1)
    return WorkerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def ctl(cluster, demo):
    config = ControllerConfig(checkpoint=CheckpointPolicy(every=K), reorder_s=0.05, health_interval_s=0.5,
                              health_timeout_s=HEALTH_TIMEOUT)
    handle = start_controller([worker_config(demo)] * 3, config=config, worker_options=OPTIONS)
    yield handle
    ray.kill(handle)


@pytest.fixture(autouse=True)
def _leave_the_controller_clean(request):
    """After each test on the module's controller: every conversation it left open is closed and every
    worker it left draining admits again, so one failing test is reported alone instead of taking the
    room of every test after it."""
    yield
    if "ctl" not in request.fixturenames:
        return
    handle = request.getfixturevalue("ctl")
    for conv in ray.get(handle.affinity.remote()):
        try:
            ray.get(handle.close.remote(conv))
        except Exception:  # noqa: BLE001 - a conversation that a failed test broke: it goes either way
            pass
    for name, w in ray.get(handle.status.remote())["workers"].items():
        if w["alive"] and w["draining"]:
            ray.get(handle.undrain.remote(name))


# --------------------------------------------------------------------------- streams
def prompt(model, seed: int):
    return [s + seed * 0.01 for s in model.initial_state()]


_SOLO: dict[tuple[int, int], str] = {}


def solo_digest(demo, seed: int, chunks: int) -> str:
    """SHA-256 of the frames of conversation ``seed`` run alone through the unmodified programs."""
    if (seed, chunks) not in _SOLO:
        model, eps, _path, _digest = demo
        ref, state, frames = cf.reference(eps), prompt(model, seed), []
        for k in range(chunks):
            tok, noise = demo_inputs(CFG, seed, k)
            out = ref(tok, *state, noise)
            frames.append(out[0].clone())
            state = [t.clone() for t in out[1:]]
        _SOLO[(seed, chunks)] = sha256(frames)
    return _SOLO[(seed, chunks)]


class Streams:
    """Client side of several conversations: every chunk's reply, by conversation and sequence number."""

    def __init__(self, ctl, demo, seeds: dict[str, int]):
        self.ctl, self.demo, self.seeds = ctl, demo, seeds
        self.got: dict[str, dict[int, torch.Tensor]] = {c: {} for c in seeds}
        self.workers: dict[str, list[str]] = {c: [] for c in seeds}
        self.next = {c: 0 for c in seeds}

    def open(self):
        model = self.demo[0]
        return ray.get([self.ctl.open.remote(c, seed=s, prompt=prompt(model, s)) for c, s in self.seeds.items()])

    def submit(self, convs=None):
        """One chunk of each conversation, all in flight at once; returns the refs."""
        refs = {}
        for c in convs or self.seeds:
            tok, noise = demo_inputs(CFG, self.seeds[c], self.next[c])
            refs[c] = self.send(c, self.next[c], [tok, noise])
            self.next[c] += 1
        return refs

    def send(self, conv, seq, inputs):
        return self.ctl.step.remote(conv, seq, inputs)

    def result(self, ref):
        return ray.get(ref)

    def collect(self, refs):
        for c, r in refs.items():
            res = self.result(r)
            assert res.conv_id == c and res.seq not in self.got[c], (c, res.seq)  # never twice
            self.got[c][res.seq] = res.outputs[0]
            self.workers[c].append(res.worker)

    def run(self, rounds: int, convs=None):
        for _ in range(rounds):
            self.collect(self.submit(convs))

    def check(self):
        for c, seed in self.seeds.items():
            n = self.next[c]
            assert sorted(self.got[c]) == list(range(n)), f"{c}: chunks lost or duplicated"
            assert sha256([self.got[c][k] for k in range(n)]) == solo_digest(self.demo, seed, n), \
                f"{c}: the stream differs from its solo unmodified run"

    def close(self):
        ray.get([self.ctl.close.remote(c) for c in self.seeds])


class RoutedStreams(Streams):
    """The same, through a :class:`Router` in this process (one hop per chunk): each chunk on a thread of
    its own, so every conversation's chunk is in flight at once."""

    def __init__(self, router, demo, seeds: dict[str, int]):
        super().__init__(router.controller, demo, seeds)
        self.router = router
        self.refused_twice = 0

    def open(self):
        return [self.router.open(c, seed=s, prompt=prompt(self.demo[0], s)) for c, s in self.seeds.items()]

    def send(self, conv, seq, inputs):
        return POOL.submit(self.step, conv, seq, inputs)

    def step(self, conv, seq, inputs):
        """The router re-asks and retries a refused chunk once; a client sends it again after a second
        refusal (two moves of the conversation while one chunk is on its way): nothing was applied."""
        for _attempt in range(4):
            try:
                return self.router.step(conv, seq, inputs)
            except (Fenced, RayActorError):
                self.refused_twice += 1
        raise AssertionError(f"{conv}: chunk {seq} refused 8 times")

    def result(self, ref):
        return ref.result(timeout=60)

    def close(self):
        for c in self.seeds:
            self.router.close(c)


POOL = ThreadPoolExecutor(8, thread_name_prefix="routed-client")


def affinity(ctl):
    return ray.get(ctl.affinity.remote())


def live_workers(ctl):
    return [n for n, w in ray.get(ctl.status.remote())["workers"].items() if w["alive"]]


# --------------------------------------------------------------------------- placement rules (no Ray)
def test_choose_least_loaded_with_room_and_refuses_with_every_workers_load():
    views = [WorkerView("a", 1, 4), WorkerView("b", 1, 2), WorkerView("c", 0, 4, draining=True)]
    assert choose(views) == "a"  # by fraction of capacity; never a draining worker
    assert choose([WorkerView("a", 2, 4), WorkerView("b", 1, 2)]) == "b"  # equal fractions: fewer conversations
    full = [WorkerView("a", 4, 4), WorkerView("b", 2, 2), WorkerView("c", 0, 0, alive=False)]
    with pytest.raises(AdmissionRefused, match=r"a: 4/4, b: 2/2, c: dead"):
        choose(full)
    assert choose(full, overcommit=True) == "b"  # a resume goes past capacity rather than drop a conversation


def test_rebalance_moves_to_shares_by_capacity():
    views = [WorkerView("a", 5, 8), WorkerView("b", 0, 8), WorkerView("c", 1, 4)]
    moves = rebalance_moves(views, {"a": ["a1", "a2", "a3", "a4", "a5"], "c": ["c1"]})
    assert moves == [("a5", "a", "b"), ("a4", "a", "b")]  # shares 2.4, 2.4, 1.2
    assert rebalance_moves([WorkerView("a", 2, 4), WorkerView("b", 1, 4)], {"a": ["x", "y"], "b": ["z"]}) == []


def test_calibration_measures_capacity_against_the_deadline(demo):
    relaxed = ConversationWorker(worker_config(demo, capacity=None, deadline_s=1.0, calibrate_max=3, calibrate_rounds=2))
    cal = relaxed.status().calibration
    assert (cal.capacity, cal.source, cal.bound) == (3, "calibrated", "max_n") and sorted(cal.p99_ms) == [1, 2, 3]
    assert relaxed.status().conversations == () and relaxed.status().chunks == 0  # scratch conversations gone
    strict = ConversationWorker(worker_config(demo, capacity=None, deadline_s=1e-6, calibrate_max=3))
    assert (strict.capacity, strict.calibration.bound) == (0, "deadline")
    with pytest.raises(AdmissionRefused, match="at capacity: 0 of 0"):
        strict.open("x", seed=1)


# --------------------------------------------------------------------------- the cluster
def test_workers_are_ready_from_the_artifact_on_separate_nodes(ctl):
    st = ray.get(ctl.status.remote())
    assert sorted(st["workers"]) == ["worker-0", "worker-1", "worker-2"]
    for w in st["workers"].values():
        assert w["alive"] and w["capacity"] == CAPACITY and w["lanes"] == 1
        assert 0 < w["ready_s"] <= w["spawn_to_ready_s"] and "given in the worker's config" in w["calibration"]
    nodes = {ray.get(ray.get(ctl.worker_handle.remote(n)).status.remote()).node_id for n in st["workers"]}
    assert len(nodes) == 3  # one worker per node: moves cross object stores


def test_placement_spreads_and_every_chunk_goes_to_the_worker_holding_the_state(ctl, demo):
    s = Streams(ctl, demo, {"p1": 11, "p2": 12, "p3": 13})
    opened = s.open()
    assert len({o["worker"] for o in opened}) == 3  # least loaded first: one each
    s.run(6)
    table = affinity(ctl)
    for c in s.seeds:
        assert set(s.workers[c]) == {table[c]}
    s.check()
    s.close()


def test_admission_refuses_at_capacity_with_the_reason_and_queues_when_asked(ctl, demo):
    model = demo[0]
    refused = ray.get(ctl.status.remote())["metrics"]["counters"]["admission_refused"]
    convs = [f"full{i}" for i in range(3 * CAPACITY)]
    ray.get([ctl.open.remote(c, seed=i, prompt=prompt(model, i)) for i, c in enumerate(convs)])
    with pytest.raises(AdmissionRefused, match=r"every worker is at capacity.*worker-0: 3/3"):
        ray.get(ctl.open.remote("one-more", seed=1))
    with pytest.raises(AdmissionRefused, match=r"waited 0.2 s"):
        ray.get(ctl.open.remote("one-more", seed=1, wait_s=0.2))
    queued = ctl.open.remote("queued", seed=5, prompt=prompt(model, 5), wait_s=20.0)
    time.sleep(0.3)
    ray.get(ctl.close.remote(convs[0]))  # room: the queued open goes in
    assert ray.get(queued)["conv_id"] == "queued"
    st = ray.get(ctl.status.remote())
    assert st["metrics"]["counters"]["admission_refused"] == refused + 2
    ray.get([ctl.close.remote(c) for c in convs[1:] + ["queued"]])


def test_wrong_sequence_numbers_and_unknown_or_closed_conversations_are_refused(ctl, demo):
    s = Streams(ctl, demo, {"seq": 21})
    s.open()
    tok, noise = demo_inputs(CFG, 21, 0)
    with pytest.raises(SequenceError, match=r"chunk 1 skips chunk\(s\) 0..0"):
        ray.get(ctl.step.remote("seq", 1, [tok, noise]))
    s.run(2)
    with pytest.raises(SequenceError, match="chunk 1 was already applied"):
        ray.get(ctl.step.remote("seq", 1, [tok, noise]))
    worker = ray.get(ctl.worker_handle.remote(affinity(ctl)["seq"]))
    with pytest.raises(SequenceError, match="chunk 0 was already applied"):  # the worker checks too
        ray.get(worker.step.remote("seq", 0, [tok, noise]))
    s.run(1)
    s.check()  # the refused chunks changed nothing
    with pytest.raises(UnknownConversation, match="no conversation 'nobody'"):
        ray.get(ctl.step.remote("nobody", 0, [tok, noise]))
    s.close()
    with pytest.raises(ConversationClosed, match="'seq' was closed"):
        ray.get(ctl.step.remote("seq", 3, [tok, noise]))
    with pytest.raises(ConversationClosed):
        ray.get(worker.step.remote("seq", 3, [tok, noise]))


def test_migration_mid_stream_is_bit_exact(ctl, demo):
    s = Streams(ctl, demo, {"mover": 31})
    source = s.open()[0]["worker"]
    s.run(5)
    target = next(w for w in ("worker-0", "worker-1", "worker-2") if w != source)
    report = ray.get(ctl.migrate.remote("mover", target))
    assert (report.source, report.target) == (source, target) and report.nbytes > 0 and report.seconds > 0
    assert report.path == "host"  # CPU workers name no GPU: no device handoff
    assert affinity(ctl)["mover"] == target
    src = ray.get(ctl.worker_handle.remote(source))
    assert "mover" not in ray.get(src.conversations.remote())
    s.run(5)
    assert s.workers["mover"] == [source] * 5 + [target] * 5
    s.check()
    s.close()


def test_snapshot_and_restore_rewind_a_conversation(ctl, demo):
    s = Streams(ctl, demo, {"turns": 41})
    s.open()
    s.run(3)
    snap = ctl.snapshot.remote("turns")  # a turn boundary, kept in the object store
    # the controller is an async actor: Ray runs its calls concurrently, in no promised order, so a
    # client takes the snapshot before it sends the next chunk (the front end awaits it too)
    ray.wait([snap], fetch_local=False)
    s.run(2)
    first = dict(s.got["turns"])
    assert ray.get(ctl.restore.remote("turns", snap)) == 3  # barge-in: back to chunk 3
    s.next["turns"] = 3
    for k in (3, 4):
        del s.got["turns"][k]
    s.run(2)
    assert all(torch.equal(first[k], s.got["turns"][k]) for k in (3, 4))
    s.run(2)
    s.check()
    s.close()


def test_drain_then_rebalance_move_live_conversations(ctl, demo):
    s = Streams(ctl, demo, {f"d{i}": 50 + i for i in range(5)})
    s.open()
    s.run(2)
    placed = affinity(ctl)
    drained = max(("worker-0", "worker-1", "worker-2"), key=lambda w: list(placed.values()).count(w))
    before = [c for c, w in placed.items() if w == drained]
    reports = ray.get(ctl.drain.remote(drained))
    assert sorted(r.conv_id for r in reports) == sorted(before)
    assert drained not in affinity(ctl).values()
    assert ray.get(ctl.open.remote("after-drain", seed=59))["worker"] != drained  # drained: takes none
    ray.get(ctl.close.remote("after-drain"))
    s.run(2)
    ray.get(ctl.undrain.remote(drained))
    moves = ray.get(ctl.rebalance.remote())
    assert moves and all(m.target == drained for m in moves)
    counts = [list(affinity(ctl).values()).count(w) for w in ("worker-0", "worker-1", "worker-2")]
    assert max(counts) - min(counts) <= 1
    s.run(2)
    s.check()
    s.close()


def _kill_during_traffic(ctl, demo, seeds, kill, *, rounds: int = 10, kill_at: int = 5):
    """Drive ``seeds``' conversations; at round ``kill_at``, with every chunk of that round in flight,
    ``kill(handle)`` the worker holding the most of them. Returns (streams, the killed worker's name)."""
    s = Streams(ctl, demo, seeds)
    s.open()
    victim = None
    for r in range(rounds):
        refs = s.submit()
        if r == kill_at:
            owners = [affinity(ctl)[c] for c in seeds]
            victim = max(set(owners), key=owners.count)
            kill(ray.get(ctl.worker_handle.remote(victim)))
        s.collect(refs)
    return s, victim


def test_failover_after_ray_kill_during_traffic_loses_and_duplicates_nothing(ctl, demo):
    seeds = {f"k{i}": 70 + i for i in range(5)}
    s, victim = _kill_during_traffic(ctl, demo, seeds, lambda h: ray.kill(h, no_restart=True))
    st = ray.get(ctl.status.remote())
    assert not st["workers"][victim]["alive"] and victim not in affinity(ctl).values()
    resumed = [r for r in ray.get(ctl.resumes.remote()) if r["from"] == victim]
    assert resumed and all(r["replayed"] <= K and r["to"] != victim for r in resumed)
    # from a checkpoint (not the prompt), with the chunks since re-run
    assert any(r["base_seq"] > 0 for r in resumed) and any(r["replayed"] > 0 for r in resumed), resumed
    s.check()
    s.close()
    # a replacement of two lanes, from the artifact's bytes in the object store (no shared file system)
    shared = share_artifact(demo[2])
    st = ray.get(ctl.add_worker.remote(worker_config(demo, artifact=shared, lanes=2), "worker-3", OPTIONS))
    assert st.lanes == 2 and st.capacity == CAPACITY


def test_failover_after_sigkill_of_the_worker_process_resumes_idle_ones_too(ctl, demo):
    seeds = {f"s{i}": 80 + i for i in range(5)}
    placed_first = {}

    def sigkill(handle):
        placed_first.update(affinity(ctl))
        os.kill(ray.get(handle.pid.remote()), signal.SIGKILL)

    # "s0" sends two chunks and then nothing: it is resumed when its worker's death is found, before
    # its next chunk (the victim is chosen as s0's worker)
    s = Streams(ctl, demo, seeds)
    s.open()
    s.run(2)
    victim = affinity(ctl)["s0"]
    for r in range(2, 10):
        refs = s.submit([c for c in seeds if c != "s0"])
        if r == 5:
            sigkill(ray.get(ctl.worker_handle.remote(victim)))
        s.collect(refs)
    deadline = time.monotonic() + 10
    while affinity(ctl)["s0"] == victim and time.monotonic() < deadline:
        time.sleep(0.05)
    assert affinity(ctl)["s0"] != victim  # resumed while idle
    s.run(2)
    s.check()
    moved = [c for c, w in placed_first.items() if w == victim and c in seeds]
    assert {r["conv_id"] for r in ray.get(ctl.resumes.remote()) if r["from"] == victim} >= set(moved)
    s.close()


def test_a_hung_worker_is_found_by_its_ping_fenced_and_failed_over(ctl, demo):
    """A worker that stops answering (SIGSTOP: a hang, not a death Ray would report) is found by the
    controller's ping, fenced, and its conversations resumed, the chunk waiting on it included."""
    s = Streams(ctl, demo, {f"h{i}": 120 + i for i in range(3)})
    s.open()
    s.run(2)
    victim = affinity(ctl)["h0"]
    pid = ray.get(ray.get(ctl.worker_handle.remote(victim)).pid.remote())
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        s.run(3)  # h0's chunk waits on the hung worker until the ping gives up on it
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # fenced by then: it is never sent anything again
        except ProcessLookupError:
            pass
    assert time.monotonic() - t0 < HEALTH_TIMEOUT + 10
    assert not ray.get(ctl.status.remote())["workers"][victim]["alive"] and victim not in affinity(ctl).values()
    s.check()
    s.close()
    ray.get(ctl.add_worker.remote(worker_config(demo), "worker-5", OPTIONS))  # a replacement


@pytest.mark.parametrize("path", ["controller", "router"])
def test_moves_checkpoints_and_a_kill_at_random_during_traffic_keep_every_stream_exact(ctl, demo, path):
    """Chunks of six conversations in flight while migrations, rebalances, checkpoints and a kill land
    between them at random (seeded; ``CADENCE_SERVE_SEED`` picks another schedule: seeds 0-4 pass): each
    is serialized with the conversation's chunks by its lock, or (through a router) refused at the
    worker while a move freezes it and sent where it went."""
    rng = random.Random(int(os.environ.get("CADENCE_SERVE_SEED", "0")))
    seeds = {f"r{i}": 100 + i for i in range(6)}
    s = Streams(ctl, demo, seeds) if path == "controller" else RoutedStreams(Router(ctl), demo, seeds)
    s.open()
    for r in range(14):
        live = [n for n, w in ray.get(ctl.status.remote())["workers"].items() if w["alive"]]
        refs = s.submit()
        ops = []
        for _ in range(rng.randint(1, 3)):
            what, conv = rng.choice(["migrate", "migrate", "checkpoint", "rebalance"]), rng.choice(list(s.seeds))
            if what == "migrate":
                ops.append(ctl.migrate.remote(conv, rng.choice(live)))
            elif what == "checkpoint":
                ops.append(ctl.checkpoint.remote(conv, rng.choice(["controller", "worker"])))
            else:
                ops.append(ctl.rebalance.remote())
        if r == 7:  # the worker holding the most of them dies with everything above in flight
            owners = [affinity(ctl)[c] for c in s.seeds]
            ray.kill(ray.get(ctl.worker_handle.remote(max(set(owners), key=owners.count))), no_restart=True)
        s.collect(refs)
        for op in ops:
            try:
                ray.get(op)
            except (AdmissionRefused, NoWorkers):  # a move onto a full (or just killed) worker is refused
                pass
    s.check()
    s.close()
    ray.get(ctl.add_worker.remote(worker_config(demo), f"worker-4-{path}", OPTIONS))  # a replacement


# --------------------------------------------------------------------------- one hop: a router in this process
def test_a_router_sends_each_chunk_straight_to_the_worker_holding_its_state(ctl, demo):
    router = Router(ctl, report_every=4)
    s = RoutedStreams(router, demo, {"o1": 131, "o2": 132})
    opened = s.open()
    assert all(o["placement"].worker == o["worker"] for o in opened)
    s.run(2 * K + 1)  # checkpoints asked for after chunks 3 and 7, without waiting for them
    time.sleep(0.3)
    s.run(1)
    table = affinity(ctl)
    for c in s.seeds:
        assert set(s.workers[c]) == {table[c]}
        journal = router.journal(c)
        assert journal == list(range(journal[0], s.next[c])) and 0 < journal[0]  # trimmed at a checkpoint
    tok, noise = demo_inputs(CFG, 131, s.next["o1"])
    with pytest.raises(ValueError, match="opened for a router"):  # its journal is the router's
        ray.get(ctl.step.remote("o1", s.next["o1"], [tok, noise]))
    worker = router.placement("o1").handle
    with pytest.raises(Fenced, match="under epoch 0, not 7"):  # a stale placement is refused, nothing applied
        ray.get(worker.step.remote("o1", s.next["o1"], [tok, noise], 7))
    assert "o1" in ray.get(ctl.status.remote())["metrics"]["conversations"]  # the router's reports
    s.run(1)
    s.check()
    s.close()
    assert router.open_count() == 0 and router.stats["rerouted"] == 0


def test_migration_drain_and_a_kill_while_a_router_streams_lose_and_duplicate_nothing(ctl, demo):
    """A migration lands while the conversation's chunk is in flight (the source freezes it: the chunk
    is applied before or refused as fenced and sent to the target), a worker is killed with a chunk of
    each of its conversations in flight (resumed from the checkpoint, the router's journal re-run), a
    drain and a rebalance move the rest; the router re-asks and retries each refused chunk once."""
    assert len(live_workers(ctl)) >= 2
    router = Router(ctl)
    s = RoutedStreams(router, demo, {f"rr{i}": 140 + i for i in range(3)})  # room for them on one worker
    s.open()
    replayed = ray.get(ctl.status.remote())["metrics"]["counters"]["replayed_chunks"]
    victim = None
    for r in range(11):
        if r == K:  # the router asked for a checkpoint after chunk K - 1 without waiting: wait for it, so
            # every base is chunk K (landing after chunks the kill then loses, it would leave nothing to re-run)
            assert all(router.checkpointed(c, timeout=60) == K for c in s.seeds)
        if r == 6:
            owners = list(affinity(ctl).values())
            victim = max(set(owners), key=owners.count)
            victim_handle = ray.get(ctl.worker_handle.remote(victim))
        refs = s.submit()
        if r == 2:
            source = affinity(ctl)["rr0"]
            ray.get(ctl.migrate.remote("rr0", next(w for w in live_workers(ctl) if w != source)))
        if r == 6:  # right after the chunks were sent: they are in flight (some may be answered first)
            ray.kill(victim_handle, no_restart=True)
        s.collect(refs)
        if r == 6:
            ray.get(ctl.add_worker.remote(worker_config(demo), "worker-6", OPTIONS))  # a replacement
        if r == 8:
            drained = next(w for w in live_workers(ctl) if w in affinity(ctl).values())
            ray.get(ctl.drain.remote(drained))
            ray.get(ctl.undrain.remote(drained))
            ray.get(ctl.rebalance.remote())
    assert s.workers["rr0"][3] != s.workers["rr0"][1]  # moved after chunk 2
    resumes = [r for r in ray.get(ctl.resumes.remote()) if r["from"] == victim]
    resumed = {r["conv_id"] for r in resumes}
    assert resumed and victim not in affinity(ctl).values()
    assert all(r["base_seq"] == K for r in resumes)  # the checkpoint waited for above
    # the router's journal: chunks K and K + 1, and chunk 6 where the victim answered it before it died
    rerun = sum(6 - K + (s.workers[c][6] == victim) for c in resumed)
    assert ray.get(ctl.status.remote())["metrics"]["counters"]["replayed_chunks"] - replayed >= rerun > 0
    assert ray.get(ctl.status.remote())["metrics"]["counters"]["replayed_chunks"] > replayed  # the router's journal
    assert router.stats["rerouted"] >= 1 + len(resumed)
    s.check()
    s.close()


def test_metrics_in_prometheus_text(ctl, demo):
    s = Streams(ctl, demo, {"m1": 91})
    s.open()
    s.run(K + 1)  # a checkpoint on the way
    here = affinity(ctl)["m1"]
    ray.get(ctl.migrate.remote("m1", next(w for w in ray.get(ctl.status.remote())["workers"]
                                          if w != here and ray.get(ctl.status.remote())["workers"][w]["alive"])))
    s.run(1)
    text = ray.get(ctl.metrics_text.remote()).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    lat = families["cadence_fx_serve_chunk_latency_seconds"]
    quantiles = {x.labels.get("quantile") for x in lat.samples if x.labels.get("conversation") == "m1"}
    assert quantiles >= {"0.5", "0.99"}
    for name in ("cadence_fx_serve_worker_capacity", "cadence_fx_serve_worker_lanes_busy",
                 "cadence_fx_serve_worker_load", "cadence_fx_serve_worker_up", "cadence_fx_serve_routing_overhead_seconds",
                 "cadence_fx_serve_deadline_misses", "cadence_fx_serve_event_seconds"):
        assert name in families, name
    status = ray.get(ctl.status.remote())
    for counter, value in status["metrics"]["counters"].items():
        assert families[f"cadence_fx_serve_{counter}"].samples[0].value == value, counter
    capacity = {x.labels["worker"]: x.value for x in families["cadence_fx_serve_worker_capacity"].samples}
    assert capacity == {n: w["capacity"] for n, w in status["workers"].items()}
    events = status["metrics"]["events"]
    assert events["checkpoint"]["count"] > 0 and events["migration"]["count"] > 0
    s.check()
    s.close()


# --------------------------------------------------------------------------- the front end's seam
def test_ray_backend_is_the_front_ends_seam(ctl, demo):
    from cadence_fx.serve.protocol import ErrorCode, ProtocolError, TensorSpec
    from cadence_fx.serve.ray_backend import RayBackend, demo_prompt

    chunk, _state = ray.get(ctl.example.remote())
    backend = RayBackend(ctl, [TensorSpec.of(n, t) for n, t in chunk.items()], demo_prompt)

    async def step(k):
        return (await backend.step("fe", k, list(demo_inputs(CFG, 7, k))))[0]

    async def expect(code, call):
        with pytest.raises(ProtocolError) as e:
            await call
        assert e.value.code == code, e.value

    async def run():
        opened = await backend.open("fe", 7, 7)  # seed 7, prompt 7: the module's prompt(model, 7)
        assert [i["name"] for i in opened["inputs"]] == ["tokens", "noise"] and backend.open_count() == 1
        frames = [await step(k) for k in range(3)]
        token = await backend.snapshot("fe")
        frames += [await step(3), await step(4)]
        assert await backend.restore("fe", token) == 3  # barge-in: back to chunk 3, the same bytes again
        assert [torch.equal(await step(k), frames[k]) for k in (3, 4)] == [True, True]
        await expect(ErrorCode.BAD_SEQUENCE, backend.step("fe", 9, list(demo_inputs(CFG, 7, 9))))
        await expect(ErrorCode.UNKNOWN_CONVERSATION, backend.step("nobody", 0, list(demo_inputs(CFG, 7, 0))))
        await expect(ErrorCode.UNKNOWN_SNAPSHOT, backend.restore("fe", "no-such-token"))
        await expect(ErrorCode.BAD_PROMPT, backend.open("fe2", 1, 5000))
        await backend.close("fe")
        await backend.close("fe")  # closing a closed conversation is a no-op
        await expect(ErrorCode.CONVERSATION_CLOSED, backend.step("fe", 5, list(demo_inputs(CFG, 7, 5))))
        assert backend.open_count() == 0
        return frames

    assert sha256(asyncio.run(run())) == solo_digest(demo, 7, 5)


def test_the_front_end_streams_through_the_ray_workers(ctl, demo):
    serve = pytest.importorskip("ray.serve")
    websockets = pytest.importorskip("websockets")
    from cadence_fx.serve import frontend
    from cadence_fx.serve.protocol import StreamClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(frontend.app("cadence_fx.serve.ray_backend:ray_backend",
                               {"prompt": "cadence_fx.serve.ray_backend:demo_prompt"}, {"deadline_ms": 60_000},
                               ray_actor_options={"num_cpus": 0}), name="serve-ray-test", route_prefix="/")

        async def run():
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
                client = StreamClient(ws)
                conv = (await client.open(seed=8, prompt=8))["conv"]
                frames = [(await client.chunk(conv, k, list(demo_inputs(CFG, 8, k)))).tensors[0] for k in range(6)]
                await client.close(conv)
                return frames

        frames = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        serve.shutdown()
    assert sha256(frames) == solo_digest(demo, 8, 6)


def test_checkpoints_left_in_the_workers_object_store_survive_a_sigkill_of_it(cluster, tmp_path):
    cfg = DemoConfig(dim=64, head=64, tail=64, capacity=136)  # 262 KB of state: past Ray's inline limit
    model, contract, eps = demo_catalog(cfg)
    path = tmp_path / "larger.cfx"
    digest = cf.save(cf.optimize(eps, contract, replay="off"), path)["sha256"]
    config = WorkerConfig(str(path), sha256=digest, lanes=1, replay="off", capacity=2, threads=1)
    every = 16  # the first checkpoint after chunk 15: 147 KB of state by then
    policy = CheckpointPolicy(every=every, store="worker")  # the bytes stay on the worker's node, not the controller's
    ctl = start_controller([config] * 2, config=ControllerConfig(checkpoint=policy, health_interval_s=0.5),
                           name="worker-store", worker_options=OPTIONS)
    try:
        state = [s + 0.03 for s in model.initial_state()]
        ray.get(ctl.open.remote("larger", seed=3, prompt=state))
        got = []

        def run(chunks):
            for _ in range(chunks):
                got.append(ray.get(ctl.step.remote("larger", len(got), list(demo_inputs(cfg, 3, len(got))))).outputs[0])

        run(every + 2)  # a checkpoint after chunk 15, then two chunks in the journal
        deadline = time.monotonic() + 10
        while ray.get(ctl.status.remote())["metrics"]["events"]["checkpoint"]["count"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        events = ray.get(ctl.status.remote())["metrics"]["events"]["checkpoint"]
        assert events["count"] == 1 and events["bytes"] > 100 << 10
        victim = affinity(ctl)["larger"]
        os.kill(ray.get(ray.get(ctl.worker_handle.remote(victim)).pid.remote()), signal.SIGKILL)
        run(4)
        (resumed,) = [r for r in ray.get(ctl.resumes.remote()) if r["from"] == victim]
        assert (resumed["base_seq"], resumed["replayed"]) == (every, 2)
        ref, frames = cf.reference(eps), []
        for k in range(len(got)):
            tok, noise = demo_inputs(cfg, 3, k)
            out = ref(tok, *state, noise)
            frames.append(out[0].clone())
            state = [t.clone() for t in out[1:]]
        assert sha256(got) == sha256(frames)
    finally:
        for name, w in ray.get(ctl.status.remote())["workers"].items():
            if w["alive"]:
                ray.kill(ray.get(ctl.worker_handle.remote(name)))
        ray.kill(ctl)


def test_a_resume_refused_by_a_worker_fuller_than_the_controller_knows_goes_on_elsewhere(cluster, demo):
    """The controller's count of a worker can run behind the worker's own (a conversation opened on it
    straight, a move in flight): the worker it picks to resume on then refuses. The conversation must not
    be left pointing at that worker (which would answer "unknown conversation"): it is placed past the
    capacity (no other worker is alive) and its stream goes on bit for bit."""
    model = demo[0]
    ctl = start_controller([worker_config(demo, capacity=1)] * 2, config=ControllerConfig(
        checkpoint=CheckpointPolicy(every=K), health_interval_s=0), name="refused-resume", worker_options=OPTIONS)
    try:
        ray.get(ctl.open.remote("r", seed=5, prompt=prompt(model, 5)))
        got = []

        def run(chunks):
            for _ in range(chunks):
                got.append(ray.get(ctl.step.remote("r", len(got), list(demo_inputs(CFG, 5, len(got))))).outputs[0])

        run(3)
        home = affinity(ctl)["r"]
        (other,) = [n for n in live_workers(ctl) if n != home]
        ray.get(ray.get(ctl.worker_handle.remote(other)).open.remote("squatter", seed=1))  # behind its back
        ray.kill(ray.get(ctl.worker_handle.remote(home)), no_restart=True)
        run(3)
        assert affinity(ctl)["r"] == other
        assert ray.get(ctl.status.remote())["metrics"]["counters"]["overcommit"] >= 1
        assert sha256(got) == solo_digest(demo, 5, 6)
    finally:
        for name in live_workers(ctl):
            ray.kill(ray.get(ctl.worker_handle.remote(name)))
        ray.kill(ctl)


def test_a_conversation_state_pickles_as_byte_arrays_and_comes_back_bit_for_bit():
    """What crosses the object store: every region tensor as a byte array (out of band under pickle
    protocol 5), any dtype and layout, the same bits back; the rest of the state unchanged."""
    import pickle

    import numpy as np

    from cadence_fx.serve.conversation import ConversationState

    state = {"f32": torch.randn(4, 8), "bf16": torch.randn(3, 5).to(torch.bfloat16),
             "strided": torch.randn(4, 6)[:, ::2], "nan": torch.tensor([float("nan"), -0.0])}
    cs = ConversationState("c", state, torch.get_rng_state(), None, 5, 9, {"export_s": 0.1})
    buffers: list = []
    data = pickle.dumps(cs, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(state)  # each region out of band, none inside the pickle stream
    back = pickle.loads(data, buffers=buffers)
    for name, t in state.items():
        got = back.state[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert np.array_equal(got.contiguous().view(torch.uint8).numpy(), t.contiguous().view(torch.uint8).numpy())
    assert torch.equal(back.rng_cpu, cs.rng_cpu) and (back.next_seq, back.seed, back.meta) == (5, 9, {"export_s": 0.1})


def test_a_restartable_controller_survives_its_death_routers_stream_on_and_it_adopts_the_workers(cluster, demo):
    """``ControllerConfig(restartable=True)``: killing the controller leaves its (detached) workers and
    their sessions alive; routers keep streaming straight to them; Ray restarts the controller, which
    adopts both workers and every conversation (epochs and next chunks from the workers, a checkpoint
    each), then moves one and fails another over from its adoption checkpoint plus the router's journal.
    Every stream equals its solo unmodified run."""
    from cadence_fx.serve.adoption import worker_actor_name

    name = "cadence_fx_restartable_test"
    config = ControllerConfig(checkpoint=CheckpointPolicy(every=K), reorder_s=0.05, health_interval_s=0.5,
                              health_timeout_s=HEALTH_TIMEOUT, restartable=True)
    ctl = start_controller([worker_config(demo)] * 2, config=config, worker_options=OPTIONS, name=name)
    workers = {w: ray.get_actor(worker_actor_name(name, w)) for w in ("worker-0", "worker-1")}
    try:
        assert ray.get(ctl.status.remote())["adopted"]["workers"] == []  # a first start: nothing to adopt
        router = Router(ctl)
        s = RoutedStreams(router, demo, {"ra": 71, "rb": 72})
        for c, w in (("ra", "worker-0"), ("rb", "worker-1")):
            router.open(c, seed=s.seeds[c], prompt=prompt(demo[0], s.seeds[c]), worker=w)
        s.run(K + 2)  # a checkpoint each, then two chunks of journal
        ray.kill(ctl, no_restart=False)
        s.run(3)  # the controller is away (or restarting): chunks still go straight to the workers
        adopted = None
        for _ in range(120):
            try:
                adopted = ray.get(ctl.status.remote(), timeout=10)["adopted"]
                break
            except (RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
        assert adopted is not None, "the controller was not restarted"
        assert adopted["workers"] == ["worker-0", "worker-1"] and adopted["conversations"] == 2
        assert adopted["checkpointed"] == 2 and adopted["unprotected"] == []
        assert affinity(ctl) == {"ra": "worker-0", "rb": "worker-1"}
        s.run(2)
        report = ray.get(ctl.migrate.remote("ra", "worker-1"))  # the adopted table moves conversations
        assert (report.source, report.target) == ("worker-0", "worker-1")
        s.run(2)
        ray.kill(workers["worker-1"], no_restart=True)  # both conversations are there now
        ray.get(ctl.add_worker.remote(worker_config(demo), "worker-2", OPTIONS))
        s.run(3)  # resumed from their checkpoints (taken at adoption or after) plus the router's journal
        assert "worker-1" not in set(affinity(ctl).values())  # both resumed elsewhere
        assert len(ray.get(ctl.status.remote())["resumes"]) == 2
        s.check()
        s.close()
    finally:
        for w in ("worker-0", "worker-1", "worker-2"):
            try:
                ray.kill(ray.get_actor(worker_actor_name(name, w)), no_restart=True)
            except ValueError:
                pass
        ray.kill(ctl, no_restart=True)


# --------------------------------------------------------------------------- the reduced Token2Wav
# Last in the module (pytest runs a module's tests in file order): under xdist the artifact tests,
# which start with the run on the other worker, have saved the artifact by the time this fixture
# asks for it, so it loads their file instead of waiting for it or exporting it a second time.
T2W_CHUNKS = 5  # the attention histories at 16, 26, 36 frames, then trimmed: every catalog class


@pytest.fixture(scope="module")
def token2wav(tmp_path_factory):
    """The reduced Token2Wav (stepaudio2 0.1.2, random weights) at the chunk clock, saved once for the
    run: the artifact the artifact tests save (their worker's file, read here when it is there: the
    module pytest collected, tests/ on sys.path), and the stock step it was exported from."""
    from test_upstream_cpu import built_flow, shared_chunk_artifact_0_1_2, upstream

    from cadence_fx.adapters.token2wav import Token2WavConfig, Token2WavStep, build_vocoder, example_prompt

    cfg = Token2WavConfig.reduced()
    contract, path, digest = shared_chunk_artifact_0_1_2(cfg, tmp_path_factory)
    up = upstream("0.1.2")
    step = Token2WavStep(built_flow(up, cfg), build_vocoder(up, cfg), cfg, driver="0.1.2").eval()
    prompt_args = example_prompt(cfg)
    return step, prompt_args[2], step.setup(*prompt_args), contract, str(path), digest


def token2wav_solo(step, state, fresh, seed: int) -> list:
    """A conversation run alone through the stock step (``stock_call``: the driver's work, eagerly; the
    upstream tests check it gives the exported programs' bytes), seeded as its session is (HiFT draws:
    the same numbers), on one thread as the workers (a float sum's order depends on it)."""
    from cadence_fx.adapters.token2wav import run_stream

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return run_stream(step.stock_call, step, state, fresh)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.upstream
def test_token2wav_conversations_placed_moved_and_failed_over_give_their_solo_pcm(cluster, token2wav):
    """Two workers serve reduced-Token2Wav conversations from the saved artifact through a router:
    placed one per worker, one moved onto the other mid-stream, that worker killed with both chunks in
    flight (both resumed on the first from their checkpoints, the router's journal re-run). HiFT draws
    random numbers: a session's streams (seeded per conversation) travel in every export, so each PCM
    stream is its solo run's through the stock exported programs, seeded the same."""
    from cadence_fx.serve.controller import ServeController

    step, spk, state, contract, path, digest = token2wav
    config = WorkerConfig(path, sha256=digest, lanes=1, replay="off", capacity=2, threads=1)
    policy = ControllerConfig(checkpoint=CheckpointPolicy(every=2), health_interval_s=0.5)
    # start_controller's steps, the workers' start (load, warm-up) left running while the solo runs go
    ctl = ray.remote(ServeController).options(name="token2wav", num_cpus=0, max_concurrency=1000).remote(policy)
    joining = [ctl.add_worker.remote(config, f"worker-{i}", OPTIONS) for i in range(2)]
    try:
        seeds = {"t0": 5, "t1": 6}
        fresh = {c: step.fresh(T2W_CHUNKS, spk, seed=s) for c, s in seeds.items()}
        solo = {c: token2wav_solo(step, state, fresh[c], s) for c, s in seeds.items()}
        ray.get(joining)
        router = Router(ctl)
        initial = {r.name: state[r.input] for r in contract.regions}
        placed = {c: router.open(c, seed=s, prompt=initial)["worker"] for c, s in seeds.items()}
        assert sorted(placed.values()) == ["worker-0", "worker-1"]
        got: dict[str, list] = {c: [] for c in seeds}

        def chunk(k: int, kill: str | None = None) -> None:
            futures = {c: POOL.submit(router.step, c, k, [fresh[c][k]["token"], spk]) for c in seeds}
            if kill is not None:
                ray.kill(ray.get(ctl.worker_handle.remote(kill)), no_restart=True)
            for c, f in futures.items():
                got[c].append(f.result(timeout=120).outputs)

        chunk(0)
        chunk(1)
        ray.get(ctl.migrate.remote("t0", placed["t1"]))  # both on one worker now
        chunk(2)
        chunk(3, kill=placed["t1"])  # both resumed on the other
        chunk(4)
        assert set(affinity(ctl).values()) == {placed["t0"]}
        assert {r["conv_id"] for r in ray.get(ctl.resumes.remote())} == set(seeds)
        assert ray.get(ctl.status.remote())["metrics"]["counters"]["replayed_chunks"] > 0  # the router's journal
        for c in seeds:
            assert sha256([o[0] for o in got[c]]) == sha256([o[0] for o in solo[c]]), f"{c}: the PCM differs"
            assert sha256([t for o in got[c] for t in o]) == sha256([t for o in solo[c] for t in o[:2]])  # + mel
    finally:
        for name, w in ray.get(ctl.status.remote())["workers"].items():
            if w["alive"]:
                ray.kill(ray.get(ctl.worker_handle.remote(name)))
        ray.kill(ctl)
