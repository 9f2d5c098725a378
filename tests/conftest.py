import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*not a module, parameter, or buffer.*")
warnings.filterwarnings("ignore", message=".*does not reference an nn.Module.*")


# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine, ``--dist loadgroup``) a
# module runs whole on one worker, so its module fixtures (exports, optimized programs, a Ray cluster)
# are built once; modules that share something run on the same worker: the Ray modules (one local
# cluster at a time on the machine) and the Token2Wav artifact tests with the upstream tests that
# share its exported catalog (those carry their own ``xdist_group("token2wav")`` marker). The other
# upstream tests share nothing and are a minute or two each: each is a unit of its own, so the two
# workers can split them.
_GROUPS = {"test_serve_ray": "ray", "test_serve_frontend": "ray", "test_serve_token2wav_bench": "ray",
           "test_serve_capacity_bench": "ray", "test_artifact": "token2wav"}
_PER_TEST = {"test_upstream_cpu"}
# the longest units go first (with ``--no-loadscope-reorder`` the workers take units in this order), so
# no worker starts a long one when the other is about to finish: longest-first keeps the two together
_FIRST = ("ray", "token2wav", "test_upstream_cpu::test_full_step_1_0_7",
          "test_upstream_cpu::test_full_step_0_1_2_float16",
          "test_upstream_cpu::test_token2wav_example_streams_bit_identical")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one thread each, no oversubscription; the processes a test starts get
    # the same (a CPU program's bytes depend on its thread count: a loaded artifact in a child process
    # with two threads gave other bytes than the same program here with one)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# before xdist's own hook, which reads the groups into the node ids: after it they would group nothing
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    units = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        marked = item.get_closest_marker("xdist_group")
        if marked is None:
            name = _GROUPS.get(module, module)
            if module in _PER_TEST:
                name = f"{module}::{item.originalname}"
            item.add_marker(pytest.mark.xdist_group(name))
        else:
            name = marked.args[0] if marked.args else marked.kwargs.get("name", "default")
        units[item] = name
    rank = {name: i for i, name in enumerate(_FIRST)}
    position = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(units[it], len(rank)), position[it]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
