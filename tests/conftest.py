import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*not a module, parameter, or buffer.*")
warnings.filterwarnings("ignore", message=".*does not reference an nn.Module.*")


# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine) every module runs whole on
# one worker, so its module fixtures (exports, optimized programs) are built once; modules that share
# something run on the same worker: the Ray modules (one local cluster at a time on the machine) and
# the two Token2Wav modules (test_artifact reads test_upstream_cpu's catalog cache).
_GROUPS = {"test_serve_ray": "ray", "test_serve_frontend": "ray", "test_serve_token2wav_bench": "ray",
           "test_serve_capacity_bench": "ray",
           "test_artifact": "token2wav", "test_upstream_cpu": "token2wav"}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one thread each, no oversubscription; the processes a test starts get
    # the same (a CPU program's bytes depend on its thread count: a loaded artifact in a child process
    # with two threads gave other bytes than the same program here with one)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        item.add_marker(pytest.mark.xdist_group(_GROUPS.get(module, module)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
