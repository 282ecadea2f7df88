"""Suite-wide setup. On a machine without CUDA, Triton kernels run in its interpreter, and triton must be imported
in interpreter mode before anything else imports it (see k3c/codegen/triton_mode.py)."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    from k3c.codegen.triton_mode import prepare_interpreter

    prepare_interpreter()


def _share_cores_between_test_processes() -> None:
    """Under pytest-xdist, each test process gets its share of the cores for torch's threads (and for the
    processes a test starts): two processes each running OpenMP on every core slow each other's small ops down
    several times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


_share_cores_between_test_processes()


@pytest.fixture
def one_thread():
    """Single-threaded torch for the duration of a test (the settings restored after): suites of many tiny ops
    run 10-100x slower with OpenMP threads contending on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def bench_script():
    """load(name): bench/<name>.py as a module (the benchmarks are scripts, not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(root, "bench", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.fixture(scope="module")
def aot_dir(request, tmp_path_factory):
    """A scratch directory for ahead-of-time compiles, with K3C_CACHE_DIR inside it (one per test module); the
    compile worker processes are shut down after the module."""
    from k3c.codegen.aot import shutdown_workers

    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        yield root
    shutdown_workers()


@pytest.fixture(scope="module")
def tiny(request):
    """(spec, compiled model, fp32 weights of seed 0) of examples/k3-tiny.yaml, compiled for the test module's
    TINY_TARGET (mi355x when it names none). A module that needs another shape of fixture defines its own."""
    import k3c

    spec = k3c.load_spec("examples/k3-tiny.yaml")
    target = getattr(request.module, "TINY_TARGET", "mi355x")
    return spec, k3c.compile(spec, target=target), k3c.init_weights(spec, seed=0)

