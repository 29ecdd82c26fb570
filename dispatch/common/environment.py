"""What this machine offers the tool: Python, numpy, CuPy, the CUDA device, nvcc, the codebooks."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from typing import Any

import numpy as np

from ...kernels.codebooks import CODEBOOKS
from ...kernels.errors import EnvironmentProblem


def nvcc_version() -> str | None:
    """`release X.Y` of the nvcc on PATH, or None when there is none."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def cuda_device() -> dict[str, Any] | str:
    """Properties of CUDA device 0, or a sentence saying why there is none."""
    from ...kernels import launch

    try:
        cp = launch.require_device()
    except EnvironmentProblem as err:
        return f"none ({err})"
    props = cp.cuda.runtime.getDeviceProperties(0)
    return {
        "name": props["name"].decode(),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
    }


def cupy_version() -> str | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy.__version__


def describe() -> dict[str, Any]:
    from .. import __version__

    return {
        "tool": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": cupy_version() or "not installed",
        "cuda_device": cuda_device(),
        "nvcc": nvcc_version() or "not found",
        "codebooks": ", ".join(CODEBOOKS),
    }
