"""kernels.launch on the CPU: what it hands the kernels, with numpy standing in for CuPy where the code is array-API
generic (the GPU tests run it on the device)."""

import types

import numpy as np
import pytest
from gemv_dispatch.kernels import launch, program, registry
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from gemv_dispatch.kernels.layout import plane_shapes


@pytest.mark.parametrize(("codebook", "k", "present"), [("Q5_0", 32, ("payload", "high", "scale")),
                                                      ("Q4_K", 256, ("payload", "scale", "min", "sub"))])
def test_launches_pass_the_planes_in_declared_order(codebook, k, present):
    """DeviceWeights.plane_args follows the source's declaration (the super-block formats' sub-block scale plane
    fifth), null for a plane the codebook lacks."""
    assert program.planes() == ("payload", "high", "scale", "minv", "sub")
    planes = {f: np.zeros(2, np.uint32) if f in present else None for f in ("payload", "high", "scale", "min", "sub")}
    args = launch.DeviceWeights(codebook, 8, k, **planes).plane_args()
    assert [a is planes[f] if f in present else a == 0 for f, a in zip(
        ("payload", "high", "scale", "min", "sub"), args, strict=True)] == [True] * 5


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_random_device_weights_have_the_planes_pack_makes(codebook, monkeypatch):
    """kernels.launch.random_weights, run with numpy standing in for CuPy (the same array API): every plane of
    the format, in pack's shapes and dtypes, fp16 scales finite in [1e-3, 1e-2)."""
    monkeypatch.setattr(launch, "cupy", types.SimpleNamespace(float16=np.float16, float32=np.float32,
                                                              uint16=np.uint16, uint64=np.uint64))
    assert launch.require_cupy() is launch.cupy
    n, k = 24, 512
    w = launch.random_weights(codebook, n, k, np.random.default_rng(7))
    want = plane_shapes(codebook, n, k)
    got = {"payload": w.payload, "scale": w.scale, "min": w.min, "high": w.high, "sub": w.sub}
    assert {name for name, a in got.items() if a is not None} == set(want)
    for name, (shape, dtype) in want.items():
        assert got[name].shape == shape, name
        assert got[name].dtype == (np.uint16 if dtype == np.float16 else dtype), name  # fp16 as its bits
    scales = w.scale.view(np.float16).astype(np.float32)
    assert np.isfinite(scales).all() and (scales >= 9.99e-4).all() and (scales < 1.0001e-2).all()


def test_staged_kernels_opt_in_to_the_rings_shared_memory_and_no_other_does():
    """opt_in raises a staged kernel's dynamic shared memory cap to RING_SHARED_LIMIT (Candidate.shared_bytes gives a
    staged walk's ring more than the default SHARED_MEMORY_LIMIT where it fits) and leaves every other kernel's."""
    class Kernel:
        max_dynamic_shared_size_bytes = registry.SHARED_MEMORY_LIMIT

    staged, mma = Kernel(), Kernel()
    assert launch.opt_in("gemv_staged<6, 1, true>", staged) is staged
    assert staged.max_dynamic_shared_size_bytes == registry.RING_SHARED_LIMIT
    launch.opt_in("gemv_mma<6, 2, 1, false, 128, false>", mma)
    assert mma.max_dynamic_shared_size_bytes == registry.SHARED_MEMORY_LIMIT
