"""The compact fallback (docs/policy.md §6): ilog2 alike in Python and in the rendered C, the policy file's fallback
kinds, overlays against the compact fallback's picks. Module == header == Policy.select is in test_generate.py."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.common.digests import canonical_bytes, content_digest
from gemv_dispatch.dispatch.learn.compact import ilog2
from gemv_dispatch.dispatch.learn.policy import Policy
from gemv_dispatch.dispatch.learn.train import Measurements, TrainOptions, best_launch, fit_policy
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.table import bundle, generate
from gemv_dispatch.kernels.errors import InputError
from policy_fixture import random_policy, trained_compact_policy
from seeds import fresh_seed

GOLDEN_INVENTORIES = "1" * 64
ILOG2_DRIVER = r"""
#include <stdio.h>
#include <inttypes.h>
#include "dispatch_table.h"
int main(void) {
    uint64_t x;
    while (scanf("%" SCNu64, &x) == 1) printf("%" PRId64 "\n", gemv_dispatch_ilog2(x));
    return 0;
}
"""


@pytest.fixture(scope="module")
def compact_policy(tmp_path_factory) -> Policy:
    return trained_compact_policy(tmp_path_factory.mktemp("corpus"))


def edge_values(seed: int) -> list[int]:
    """1, powers of two and their neighbours up to 2^63 - 1, the mantissa's 2^16 / 2^17 edges, random values."""
    rng = np.random.default_rng(seed)
    out = {1, 2, 3, (1 << 63) - 1}
    for e in range(63):
        out |= {max(1, (1 << e) + d) for d in (-1, 0, 1)}
    out |= {int(v) for v in rng.integers(1, 1 << 62, 2000, dtype=np.int64)}
    out |= {int(v) for v in rng.integers(1, 1 << 20, 2000)}
    return sorted(v for v in out if v < 1 << 63)


def test_ilog2_is_64ths_of_an_octave_rounded_down():
    for x in edge_values(0):
        want = 64 * math.log2(x)
        # never high; squaring a truncated mantissa six times loses a little more than one 64th at most
        assert want - 1.01 <= ilog2(x) <= want + 1e-9, x
    assert [ilog2(1 << e) for e in range(63)] == [64 * e for e in range(63)]


def test_ilog2_python_equals_c(compact_policy, tmp_path):
    seed = fresh_seed()
    values = edge_values(seed)
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH")
    (tmp_path / "dispatch_table.h").write_bytes(generate.render(compact_policy, GOLDEN_INVENTORIES)[bundle.HEADER])
    (tmp_path / "driver.c").write_text(ILOG2_DRIVER)
    subprocess.run(["cc", "-std=c99", "-O1", "-Wall", "-Wextra", "-pedantic", "-Werror", "-o", "driver", "driver.c"],
                   check=True, cwd=tmp_path)
    out = subprocess.run([str(tmp_path / "driver")], input="".join(f"{v}\n" for v in values), capture_output=True,
                         text=True, check=True).stdout.split()
    for v, got in zip(values, out, strict=True):
        assert int(got) == ilog2(v), f"seed {seed}: ilog2({v}) C {got}, Python {ilog2(v)}"


def test_compact_policy_round_trips_and_keeps_its_keys(compact_policy):
    data = json.loads(compact_policy.to_bytes())
    assert data["fallback"]["kind"] == "compact"
    assert set(data["fallback"]) == {"kind", "identity_model", "launch_model"}
    assert data["options"]["fallback"] == "compact"
    assert Policy.from_bytes(compact_policy.to_bytes()).to_bytes() == compact_policy.to_bytes()
    model = data["fallback"]["launch_model"]
    assert model["leaf_scale"] == 1 << 24 and all(len(t["leaves"]) == 1 << model["depth"] for t in model["trees"])


def test_default_policy_gains_no_key():
    """The trees' policy file holds what it always held (the committed-table test checks the bytes)."""
    data = json.loads(random_policy(3).to_bytes())
    assert set(data["fallback"]) == {"identity_tree", "launch_tree"}
    assert set(TrainOptions().to_dict()) == {"profile", "identity_tree", "launch_tree", "predicted_weight",
                                             "random_state"}


@pytest.mark.parametrize("fallback", [{"kind": "forest", "identity_tree": None}, {"kind": "trees"},
                                      {"kind": "compact", "identity_model": {}, "launch_model": {}}, []])
def test_unknown_or_broken_fallback_refused_in_one_line(compact_policy, fallback):
    obj = json.loads(compact_policy.to_bytes())
    obj["fallback"] = fallback
    del obj["digest"]
    obj["digest"] = content_digest(obj)
    with pytest.raises(InputError) as err:
        Policy.from_bytes(canonical_bytes(obj), "p.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("p.json: ")
    if isinstance(fallback, dict) and fallback.get("kind") == "forest":
        assert "kind 'forest'" in str(err.value)


def test_bad_fallback_option_refused():
    with pytest.raises(InputError):
        TrainOptions(fallback="forest")
    assert "--fallback [trees|compact]" in CliRunner().invoke(main, ["train", "--help"]).output
    assert "--fallback [trees|compact]" in CliRunner().invoke(main, ["evaluate", "--help"]).output


def test_overlays_make_a_compact_policy_exact_on_measured_cells(tmp_path):
    """with_overlays judges the compact fallback's own picks: with overlays the policy is exact on every cell."""
    from corpus_fixture import build_corpus
    from gemv_dispatch.dispatch.learn.compact import CompactParams

    meas = Measurements.from_corpus(load(build_corpus(tmp_path)))
    # tiny models, so that the fallback is wrong somewhere and overlays are needed
    params = CompactParams(launch_trees=2, identity_trees=2, teacher_trees=2, teacher_depth=2, grid=10,
                           launch_depth=2, identity_depth=2)
    policy = fit_policy(meas, TrainOptions(fallback="compact", compact=params))
    assert policy.compact is not None and (policy.identity_overlays or policy.launch_overlays)
    for key, cell in meas.times.items():
        cb, m, n, k, _ = key
        ident = policy.select(cb, 1, n, k).identity
        best = cell[best_launch(cell, ident, m, n, k, meas.noise_rel)]
        assert cell[policy.select(*key).candidate] <= best * (1 + meas.noise_rel), key
    again = fit_policy(meas, TrainOptions(fallback="compact", compact=params))
    assert again.to_bytes() == policy.to_bytes(), "training is deterministic"


CACHE_DRIVER = r"""
#include <stdio.h>
#include <inttypes.h>
#include "dispatch_table.h"
int main(void) {
    static gemv_dispatch_identity_cache cache;
    int cb, mode;
    int64_t m, n, k;
    gemv_dispatch_choice a, b;
    long same = 0, all = 0;
    while (scanf("%d %" SCNd64 " %" SCNd64 " %" SCNd64 " %d", &cb, &m, &n, &k, &mode) == 5) {
        int ra = gemv_dispatch_select(cb, m, n, k, mode, &a);
        int rb = gemv_dispatch_select_cached(&cache, cb, m, n, k, mode, &b);
        all++;
        same += ra == rb && (ra != 0 || (a.candidate == b.candidate && a.identity == b.identity
                                         && a.overlay == b.overlay));
    }
    printf("%ld %ld\n", same, all);
    return 0;
}
"""


def test_identity_cache_answers_as_select(compact_policy, tmp_path):
    """gemv_dispatch_select_cached == gemv_dispatch_select on keys of a few shapes (hits, and collisions that
    replace a slot), overlay shapes among them."""
    seed = fresh_seed()
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH")
    rng = np.random.default_rng(seed)
    shapes = [(int(rng.integers(0, len(compact_policy.codebooks))), int(rng.integers(1, 300_000)),
               256 * int(rng.integers(1, 257))) for _ in range(400)]
    shapes += [(compact_policy.codebooks.index(cb), n, k) for cb, n, k in compact_policy.identity_overlays]
    lines = []
    for _ in range(20_000):
        cb, n, k = shapes[int(rng.integers(0, len(shapes)))]
        lines.append(f"{cb} {int(rng.choice([1, 2, 4, 16, 31]))} {n} {k} {int(rng.integers(0, 2))}\n")
    (tmp_path / "dispatch_table.h").write_bytes(generate.render(compact_policy, GOLDEN_INVENTORIES)[bundle.HEADER])
    (tmp_path / "driver.c").write_text(CACHE_DRIVER)
    subprocess.run(["cc", "-std=c99", "-O1", "-Wall", "-Wextra", "-pedantic", "-Werror", "-o", "driver", "driver.c"],
                   check=True, cwd=tmp_path)
    same, total = subprocess.run([str(tmp_path / "driver")], input="".join(lines), capture_output=True, text=True,
                                 check=True).stdout.split()
    assert same == total == str(len(lines)), f"seed {seed}"
