"""Byte-level comparison of float32 results: +0/−0 and NaN payloads are distinct values here."""

import numpy as np


def bits(a: np.ndarray) -> np.ndarray:
    """The raw uint32 patterns of a float32 array (any other dtype is a test bug, not data to convert)."""
    a = np.ascontiguousarray(a)
    assert a.dtype == np.float32, f"expected float32, got {a.dtype}"
    return a.view(np.uint32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "results") -> None:
    """Byte equality of two float32 arrays; on failure name how many differ and the first one."""
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    bad = np.argwhere(g != w)
    if bad.size:
        at = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {g.size} elements differ; first at {[int(i) for i in at]}: got {g[at]:#010x} "
            f"({g.view(np.float32)[at]!r}), want {w[at]:#010x} ({w.view(np.float32)[at]!r})"
        )
