import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*not a module, parameter, or buffer.*")
warnings.filterwarnings("ignore", message=".*does not reference an nn.Module.*")


# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine) the scheduler below hands
# out units: a module by default, so its module fixtures (exports, optimized programs, a Ray cluster)
# are built once; modules and tests that share something form one unit: the Ray modules (one local
# cluster at a time on the machine) and the Token2Wav artifact tests with the upstream tests that read
# the catalog they save. The other upstream tests share nothing and are a minute or two each: each is
# a unit of its own, so the two workers can split them.
#
# The units are this file's own scheduler, not ``xdist_group`` markers: pytest 9.2 derives a node id
# from its structured id, so the ``@group`` suffix xdist 3.8 writes into ``item._nodeid`` never
# reaches the id the scheduler reads, and every test was a unit of its own (module fixtures built
# on both workers, two Ray clusters at once).
_GROUPS = {"test_serve_ray": "ray", "test_serve_frontend": "ray", "test_serve_token2wav_bench": "ray",
           "test_serve_capacity_bench": "ray", "test_artifact": "token2wav",
           "test_upstream_cpu::test_full_step_0_1_2": "token2wav",
           "test_upstream_cpu::test_chunk_clock_whole_cfm_loop_as_one_graph": "token2wav",
           "test_upstream_cpu::test_each_solver_step_replays_on_views_of_the_region": "token2wav"}
_PER_TEST = {"test_upstream_cpu"}
# the longest units go first, in the order the workers take them, so no worker starts a long one when
# the other is about to finish (longest-first keeps the two together); the units not named here are
# short and follow in collection order
_FIRST = ("ray", "token2wav", "test_upstream_cpu::test_full_step_1_0_7",
          "test_upstream_cpu::test_token2wav_example_streams_bit_identical",
          "test_upstream_cpu::test_full_step_0_1_2_float16", "test_contract_properties",
          "test_upstream_cpu::test_dit_step_exact", "test_upstream_cpu::test_bounded_vocoder_decode_replays_bit_exact",
          "test_corpus", "test_properties", "test_cadence_bench", "test_demo", "test_moshi", "test_code2wav_bench",
          "test_cadence_code2wav")


def unit(nodeid: str) -> str:
    """The scheduling unit of a test (its module, its group, or the test itself), from its node id."""
    path, _, rest = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    test = f"{module}::{rest.split('[', 1)[0]}"
    return _GROUPS.get(test) or _GROUPS.get(module) or (test if module in _PER_TEST else module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("loadgroup", "loadscope", "loadfile"):
        return None  # --dist load / each / worksteal: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling over :func:`unit`, in collection order (the hook below sorts it);
        a worker is given its next unit only once the test it runs is the last it holds, so a
        long unit is not queued behind another on one worker while the other runs dry."""

        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one thread each, no oversubscription; the processes a test starts get
    # the same (a CPU program's bytes depend on its thread count: a loaded artifact in a child process
    # with two threads gave other bytes than the same program here with one)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    position = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(unit(it.nodeid), len(rank)), position[it]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
