"""`gemv-dispatch check` (docs/policy.md §9): re-run the certification checks (table/certify.py) on a table, here.

The table's own module decides (not the policy it came from), over the shapes its certificate covered, on
this machine's GPU, or on the emulator where there is none. Any difference is reported with its shape, M,
mode, candidate and first differing element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...kernels.errors import InputError
from .bundle import Table
from .certify import (
    CHECKS,
    SHAPE_CHECKS,
    Outcome,
    Runner,
    certified_shapes,
    run_checks,
)

GLOBAL_CHECKS = tuple(c for c in CHECKS if c not in SHAPE_CHECKS)


@dataclass(frozen=True)
class CheckReport:
    level: str  # "gpu" or "emulator"
    device: str
    by_codebook: dict[str, dict[str, Outcome]]
    overall: dict[str, Outcome]  # the checks over every shape (negative control, spills)

    @property
    def passed(self) -> bool:
        outcomes = [o for per in self.by_codebook.values() for o in per.values()] + list(self.overall.values())
        return all(o.result != "fail" for o in outcomes)

    def failures(self) -> list[str]:
        return [f"{name}: {f}" for per in [*self.by_codebook.values(), self.overall]
                for name, o in per.items() for f in o.failures]


def check(table: Table, runner: Runner, log: Callable[[str], None]) -> CheckReport:
    """Run every check on `table` with `runner`: the shape checks per codebook, then the global ones.

    InputError when the runner is a GPU of another model than the table's."""
    device = runner.device()["name"]
    if runner.level == "gpu" and device != table.gpu_name:
        raise InputError(f"{table.folder}: a table for {table.gpu_name}, this GPU is a {device}")
    cert = table.certificate
    shapes = certified_shapes(cert)
    seed = int(cert["seed"])
    arch = getattr(runner, "arch", "sm_90")
    by_codebook = {}
    with runner:
        for cb in sorted({s.codebook for s in shapes}):
            log(f"check {cb}:")
            by_codebook[cb] = run_checks(runner, table.module.select, [s for s in shapes if s.codebook == cb], seed,
                                         SHAPE_CHECKS, arch, log)
        log("check, every codebook:")
        overall = run_checks(runner, table.module.select, shapes, seed, GLOBAL_CHECKS, arch, log)
    return CheckReport(runner.level, device, by_codebook, overall)

