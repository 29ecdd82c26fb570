"""Shared fixtures: the `gpu` marker skips with a clear reason where CuPy or a CUDA device is missing."""

from __future__ import annotations

import pytest


def cuda_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install '.[cuda]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        return f"no CUDA device: {err}"
    return None if count else "no CUDA device is visible"


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or cuda_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
