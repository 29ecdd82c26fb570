"""The GPU a process works on: CUDA device 0 as CuPy sees it, its identity read one way, and one stream.

`Gpu.open()` is the one device object the sweep's timer and the certifier's runner both take (`tune` opens it
once for both): identity (name, UUID in nvidia-smi's spelling, SMs, L2, architecture) and one non-blocking
stream every launch of that stage goes to. `current_gpu()` is the identity alone, or None without a GPU.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Any

from ...kernels.errors import EnvironmentProblem, InputError

GPU_SLUG_PREFIX = "nvidia-"  # every CUDA device's name begins "NVIDIA": a folder named so is named for a GPU model


def gpu_slug(name: str) -> str:
    """Folder name of a GPU model: "NVIDIA H200" -> "nvidia-h200"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise InputError(f"GPU name {name!r} gives no folder name")
    return slug


def nvidia_smi(gpu_id: str, query: str) -> list[str] | None:
    """nvidia-smi's values for one GPU (by UUID or PCI bus id: CUDA_VISIBLE_DEVICES renumbers devices), or None."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu_id}", f"--query-gpu={query}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().split(",")]
    return values if len(values) == query.count(",") + 1 else None


def gpu_uuid(raw: bytes, pci_bus_id: str) -> str:
    """The GPU's UUID in nvidia-smi's spelling, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, from CUDA's 16 UUID
    bytes. CuPy hands them over as a C string, cut at the first zero byte: then nvidia-smi says, asked by PCI
    bus id. EnvironmentProblem when neither can (the UUID keys the corpus provenance, the GPU lock and the
    certificate)."""
    if len(raw) == 16:
        h = raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    smi = nvidia_smi(pci_bus_id, "uuid")
    if smi is None or not smi[0].startswith("GPU-"):
        raise EnvironmentProblem(f"cannot read the UUID of GPU {pci_bus_id}: CUDA gave {len(raw)} of its 16 bytes "
                                 "and nvidia-smi did not answer")
    return smi[0]


@dataclass(frozen=True)
class Gpu:
    """CUDA device 0 and the stream a stage's launches go to."""

    cp: Any  # the cupy module
    name: str
    uuid: str
    sm_count: int
    l2_bytes: int
    arch: str  # e.g. sm_90
    stream: Any  # cupy.cuda.Stream, non-blocking

    @classmethod
    def open(cls) -> Gpu:
        """InputError or EnvironmentProblem (no CuPy, driver or device) naming what is missing."""
        from ...kernels import launch

        cp = launch.require_device()
        props = cp.cuda.runtime.getDeviceProperties(0)
        return cls(cp=cp, name=props["name"].decode(),
                   uuid=gpu_uuid(bytes(props["uuid"]), cp.cuda.Device(0).pci_bus_id),
                   sm_count=int(props["multiProcessorCount"]), l2_bytes=int(props["l2CacheSize"]),
                   arch=f"sm_{props['major']}{props['minor']}", stream=cp.cuda.Stream(non_blocking=True))

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "uuid": self.uuid}


def current_gpu() -> dict[str, str] | None:
    """{"name", "uuid"} of CUDA device 0, or None on a machine without CuPy or a usable device."""
    try:
        return Gpu.open().identity()
    except (InputError, EnvironmentProblem):
        return None
