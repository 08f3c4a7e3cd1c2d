"""tests/conftest.py marks every GPU test `cuda` (so that `pytest -m cuda` runs them alone): a
test in a *_cuda.py file, one marked cuda, one whose skipif reason says it needs a GPU / CUDA, or
one parametrized with a CUDA device. These tests run on the CPU and read their own markers."""
import pytest


def _marked(request) -> bool:
    return request.node.get_closest_marker("cuda") is not None


@pytest.mark.skipif(False, reason="needs a CUDA GPU")
def test_skipif_needing_a_gpu_is_marked(request):
    assert _marked(request)


@pytest.mark.skipif(False, reason="needs 2 GPUs")
def test_skipif_needing_gpus_is_marked(request):
    assert _marked(request)


@pytest.mark.skipif(False, reason="needs torch >= 2.5")
def test_other_skipif_is_not_marked(request):
    assert not _marked(request)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_cuda_device_parameter_is_marked(request, device):
    assert _marked(request) == device.startswith("cuda")


def test_plain_cpu_test_is_not_marked(request):
    assert not _marked(request)


def test_runtime_skipped_gpu_tests_carry_the_mark():
    """A GPU test that skips from inside its body (no skipif to read) needs the mark itself:
    in tests/test_mixed_devices.py exactly the tests that call _need_cuda_kernels()."""
    import inspect

    import test_mixed_devices as m

    tests = {n: f for n, f in vars(m).items() if n.startswith("test_") and callable(f)}
    assert len(tests) >= 3
    for name, f in tests.items():
        marked = any(x.name == "cuda" for x in getattr(f, "pytestmark", []))
        assert marked == ("_need_cuda_kernels()" in inspect.getsource(f)), name
