"""Incremental certification: a new table inherits a certificate's device evidence wherever it decides alike.

Every device check of a certificate (grouped equals serial, repeat, permutation, poison, emulator equality, the
negative control, spill-free kernels) is a statement about the launches a table chooses for its keys, made with
these kernel instantiations; none depends on how the module computes its choice. So when a table is rendered
anew (another template, a policy whose digest changed but whose decisions did not), its keys split in two:
- keys the previous certificate covered, where the new table picks the same candidate: their evidence carries,
  after a CPU check that the decisions are equal (recorded as the `decisions_equal` check);
- every other key (a shape with a changed decision, a shape the previous certificate did not cover): its whole
  shape is checked again on the runner, as `certify` does.
The certificate is GPU-level only when every key is covered by GPU evidence of this GPU model: carried from a
GPU-level certificate, or checked again on such a GPU. It records what was carried, from which certificate and
device, and what ran where.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ...kernels.errors import InputError
from ..common.contract import MODES, SERVED_MS
from ..common.digests import with_digest
from ..learn.policy import Policy
from .bundle import Table, other_kernels
from .certify import (
    CHECKS,
    Outcome,
    Runner,
    Shape,
    _log,
    certificate_fields,
    certified_shapes,
    check_policy,
    measured_shapes,
    run_checks,
    sampled_shapes,
)

CARRIED = "decisions_equal"


def _decision(select: Callable[..., Any], shape: Shape, m: int, mode: str) -> str | None:
    try:
        return str(select(shape.codebook, m, shape.n, shape.k, mode).candidate)
    except (InputError, ValueError, KeyError, AttributeError):
        return None


def split_shapes(policy: Policy, previous: Table, shapes: list[Shape]) -> tuple[list[Shape], list[Shape], int]:
    """(carried shapes, shapes to check again, keys compared): a shape carries when the previous certificate
    covered it and the policy picks its candidate on every key (every M of the set, every mode)."""
    covered = {(s.codebook, s.n, s.k) for s in certified_shapes(previous.certificate)}
    carried, fresh, compared = [], [], 0
    for shape in shapes:
        same = (shape.codebook, shape.n, shape.k) in covered
        for m in SERVED_MS:
            for mode in MODES:
                if not same:
                    break
                compared += 1
                ours = _decision(policy.select, shape, m, mode)
                same = ours is not None and ours == _decision(previous.module.select, shape, m, mode)
        (carried if same else fresh).append(shape)
    return carried, fresh, compared


def carry(policy: Policy, artifacts: Mapping[str, bytes], previous: Table, runner: Runner, *, seed: int | None = None,
          corpus_folder: Any = None, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """The certificate of `policy` rendered into `artifacts`, carrying `previous`'s evidence where the decisions
    agree and checking the other shapes on `runner` (see the module docstring). InputError when `previous` cannot
    lend evidence: a failed certificate, another GPU model, another M set or modes, other kernel sources."""
    check_policy(policy, corpus_folder)
    prev = previous.certificate
    target = str(policy.source.get("gpu_name"))
    if not prev.get("passed"):
        raise InputError(f"{previous.folder}: its certificate did not pass; there is nothing to carry")
    if prev["gpu_name"] != target:
        raise InputError(f"{previous.folder}: certified for {prev['gpu_name']}, the policy is for {target}")
    if prev["m_set"] != list(SERVED_MS) or prev["modes"] != list(MODES):
        raise InputError(f"{previous.folder}: certified over M {prev['m_set']} and modes {prev['modes']}, a table "
                         f"serves M {list(SERVED_MS)} and modes {list(MODES)}")
    stale = other_kernels(prev)
    if stale:
        raise InputError(f"{previous.folder}: {stale}")
    seed = prev["seed"] if seed is None else seed
    start = time.monotonic()
    measured = measured_shapes(policy)
    shapes = measured + sampled_shapes(policy.codebooks, measured, seed)
    carried, fresh, compared = split_shapes(policy, previous, shapes)
    log(f"certify: {len(carried)} of {len(shapes)} shapes decide as {previous.folder} did ({compared} keys "
        f"compared): their evidence carries; {len(fresh)} shapes are checked on {runner.device()['name']} "
        f"({runner.level}-level)")
    outcomes: dict[str, Outcome] = {}
    if fresh:
        outcomes = run_checks(runner, policy.select, fresh, seed, CHECKS, getattr(runner, "arch", "sm_90"), log)
    equal = Outcome("pass", "host", seed, {"keys": compared, "comparisons": compared, "elements": 0, "failed": 0}, ())
    fresh_level = runner.level if fresh else None
    gpu_evidence = prev["level"] == "gpu" and (not fresh or (runner.level == "gpu"
                                                             and runner.device()["name"] == target))
    passed = all(o.result != "fail" for o in outcomes.values()) and (not fresh or set(outcomes) == set(CHECKS))
    seconds = time.monotonic() - start
    log(f"certify: {'passed' if passed else 'FAILED'} in {seconds:.1f} s ({'gpu' if gpu_evidence else 'emulator'}-"
        "level)")
    cert = certificate_fields(policy, artifacts, "gpu" if gpu_evidence else "emulator", prev["device"], seed,
                              shapes) | {
        "passed": passed,
        "emulator": None if gpu_evidence else prev.get("emulator") or {"note": "checked on the CPU emulator"},
        "checks": {CARRIED: equal.to_dict()} | {name: o.to_dict() for name, o in outcomes.items()},
        "carried": _evidence(prev) | {"via": prev["digest"], "shapes": len(carried)},
        "fresh": {"shapes": len(fresh), "level": fresh_level, "device": runner.device() if fresh else None},
        "seconds": round(seconds, 1),
    }
    return with_digest(cert)


def _evidence(prev: Mapping[str, Any]) -> dict[str, Any]:
    """Where the carried evidence was made: the certificate that ran the checks (for a certificate that carried
    itself, the one it carried from), its device, level, seed and results."""
    if "carried" in prev:
        root = prev["carried"]
        return {name: root[name] for name in ("certificate", "device", "level", "seed", "checks")}
    return {"certificate": prev["digest"], "device": prev["device"], "level": prev["level"], "seed": prev["seed"],
            "checks": {name: c["result"] for name, c in prev["checks"].items()}}
