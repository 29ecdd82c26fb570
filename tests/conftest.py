"""Shared fixtures: the `gpu` marker skips with a clear reason where CuPy or a CUDA device is missing."""

from __future__ import annotations

import pytest


def cuda_unavailable_reason() -> str | None:
    from gemv_dispatch.kernels import launch
    from gemv_dispatch.kernels.errors import EnvironmentProblem

    try:
        launch.require_device()
    except EnvironmentProblem as err:
        return str(err)
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or cuda_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
