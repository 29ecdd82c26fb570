"""Incremental certification (dispatch/table/carry.py): a table that decides as a certified one did keeps its
evidence; a changed decision is checked again, and only its shape."""

from __future__ import annotations

import dataclasses

import pytest
from gemv_dispatch.dispatch.common.paths import data_dir
from gemv_dispatch.dispatch.learn.policy import load
from gemv_dispatch.dispatch.table import bundle, carry, generate
from gemv_dispatch.dispatch.table.certify import EmulatorRunner
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import by_id, candidates_for

FOLDER = data_dir() / "generated" / "nvidia-h200"
pytestmark = pytest.mark.skipif(not (FOLDER / "policy.json").is_file(), reason=f"{FOLDER} holds no table")


@pytest.fixture(scope="module")
def committed():
    return bundle.verify(FOLDER), load(FOLDER / "policy.json")


def test_the_same_decisions_carry_every_key_at_the_gpu_level(committed):
    table, policy = committed
    cert = carry.carry(policy, generate.render(policy), table, EmulatorRunner(), log=lambda line: None)
    assert cert["passed"] and cert["level"] == "gpu" and cert["fresh"]["shapes"] == 0
    assert cert["carried"]["shapes"] == len(cert["shapes"]) == len(table.certificate["shapes"])
    assert cert["checks"][carry.CARRIED]["counts"]["comparisons"] == table.certificate["keys"]
    assert cert["device"] == table.certificate["device"]  # where the carried evidence was made
    assert bundle.read_certificate(bundle.certificate_bytes(cert), "cert") == cert


def test_a_changed_decision_is_checked_again_and_only_its_shape(committed):
    table, policy = committed
    # The smallest measured shape of Q4_0 with more than one launch of its identity at M = 2.
    cb, n, k = min(((c, n, k) for c, n, k in policy.table_shapes() if c == "q4_0"), key=lambda s: s[1] * s[2])
    old = policy.select(cb, 2, n, k, "graph")
    other = next(c.id for c in candidates_for(2, n, k)
                 if c.identity(k) == old.identity and c.id != old.candidate)
    changed = dataclasses.replace(policy, launch_overlays={**policy.launch_overlays, (cb, 2, n, k, "graph"): other})
    assert changed.select(cb, 2, n, k, "graph").candidate == other and by_id(other).valid(2, n, k)
    shapes = [s for s in _shapes(table) if s.codebook == cb]
    carried, fresh, compared = carry.split_shapes(changed, table, shapes)
    assert [(s.n, s.k) for s in fresh] == [(n, k)] and len(carried) == len(shapes) - 1
    assert compared > len(shapes)  # every key of a carried shape was compared
    cert = carry.carry(changed, generate.render(changed), table, EmulatorRunner(), log=lambda line: None)
    assert cert["fresh"]["shapes"] == 1 and cert["level"] == "emulator"  # no GPU here: no GPU-level claim
    assert cert["passed"] and all(c["result"] != "fail" for c in cert["checks"].values())


def test_another_models_or_a_failed_certificate_lends_nothing(committed):
    table, policy = committed
    other = dataclasses.replace(policy, source={**policy.source, "gpu_name": "NVIDIA H100 80GB HBM3"})
    with pytest.raises(InputError, match="certified for NVIDIA H200, the policy is for NVIDIA H100"):
        carry.carry(other, generate.render(policy), table, EmulatorRunner(), log=lambda line: None)
    failed = dataclasses.replace(table, certificate={**table.certificate, "passed": False})
    with pytest.raises(InputError, match="did not pass"):
        carry.carry(policy, generate.render(policy), failed, EmulatorRunner(), log=lambda line: None)


def _shapes(table):
    from gemv_dispatch.dispatch.table.certify import certified_shapes

    return certified_shapes(table.certificate)
