"""Generated dispatch (docs/policy.md §8): the Python module, the policy's select and the C header agree on every key;
the bytes are deterministic and match the golden files. Seeds are printed; a failure names the key."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gemv_dispatch.dispatch.learn.features import MODES
from gemv_dispatch.dispatch.table import bundle, generate
from gemv_dispatch.kernels import registry
from gemv_dispatch.kernels.codebooks import k_error
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import CANDIDATES
from policy_fixture import random_policy, trained_compact_policy

GOLDEN = Path(__file__).with_name("golden")
GOLDEN_INVENTORIES = "1" * 64  # fixed, so the golden bytes do not follow edits of corpus/shapes/
C_DRIVER = r"""
#include <stdio.h>
#include <inttypes.h>
#include "dispatch_table.h"
int main(void) {
    char codebook[32], mode[16];
    int64_t m, n, k;
    gemv_dispatch_choice c;
    while (scanf("%31s %" SCNd64 " %" SCNd64 " %" SCNd64 " %15s", codebook, &m, &n, &k, mode) == 5) {
        int rc = gemv_dispatch_select(gemv_dispatch_codebook(codebook), m, n, k, strcmp(mode, "eager") == 0, &c);
        if (rc) printf("error %d\n", rc);
        else printf("%s %" PRId64 " %s\n", gemv_dispatch_candidate_ids[c.candidate], c.identity,
                    c.overlay ? "overlay" : "fallback");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def compact_policy(tmp_path_factory):
    return trained_compact_policy(tmp_path_factory.mktemp("corpus"))


def load_module(data: bytes, tmp: Path, name: str = "dispatch_table"):
    path = tmp / f"{name}.py"
    path.write_bytes(data)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_keys(policy, rng: np.random.Generator, count: int) -> list[tuple[str, int, int, int, str]]:
    """Keys spread over every path: trained shapes (overlays) at overlay M values, log-uniform random shapes,
    and the extremes N = 1, K = 32, N·K near 2^40, N not a multiple of 8."""
    trained = list(policy.table_shapes())
    keys = []
    for i in range(count):
        cb = str(rng.choice(policy.codebooks))
        kind = i % 5
        if kind == 0:
            cb, n, k = trained[int(rng.integers(0, len(trained)))]
        elif kind == 1:
            n, k = int(np.exp(rng.uniform(0, 20))) or 1, 32 * max(1, int(np.exp(rng.uniform(0, 11))))
        elif kind == 2:
            n, k = int(rng.choice([1, 2, 3, 7, 8, 9, 127, 128, 129])), int(rng.choice([32, 64, 96, 2048, 2080]))
        elif kind == 3:  # N·K near 2^40
            k = 32 * int(rng.integers(17, 1 << 16))  # N stays <= 2^31 - 1, the C header's range
            n = max(1, (1 << 40) // k + int(rng.integers(-3, 4)))
        else:
            n, k = int(rng.integers(1, 1 << 31)), 32 * int(rng.integers(1, (1 << 31) // 32))
        m = int(rng.choice([1, 2, 4, 5, 16, 31, int(rng.integers(1, 1 << 20))]))
        # The codebook as a user may spell it: the key ("q4_k") or the GGUF type ("Q4_K"), in any case.
        cb = "".join(ch.upper() if rng.random() < 0.5 else ch for ch in cb)
        keys.append((cb, m, n, k, str(rng.choice(MODES))))
    return keys


def refused(key) -> bool:
    """Whether select refuses a key of a known codebook and mode: beyond the kernels' 32-bit plane indices, or K
    not a whole number of the codebook's super-blocks (refused by all three, GEMV_DISPATCH_BAD_SHAPE in C)."""
    return bool(registry.shape_error(*key[1:4]) or k_error(key[0], key[3]))


def c_select(header: bytes, keys, tmp: Path) -> list[str]:
    (tmp / "dispatch_table.h").write_bytes(header)
    (tmp / "driver.c").write_text(C_DRIVER)
    cc = shutil.which("cc")
    subprocess.run([cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-pedantic", "-Werror", "-o", str(tmp / "driver"),
                    str(tmp / "driver.c")], check=True, cwd=tmp)
    text = "".join(f"{cb} {m} {n} {k} {mode}\n" for cb, m, n, k, mode in keys)
    out = subprocess.run([str(tmp / "driver")], input=text, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


SUPER_BLOCK_MIX = ("iq4_xs", "q4_0", "q4_k", "q5_k", "q6_k", "q8_0")


@pytest.mark.parametrize(("seed", "codebooks"), [(11, None), (12, None), (13, SUPER_BLOCK_MIX)])
def test_module_policy_and_header_agree(seed, codebooks, tmp_path):
    """>= 150,000 seeded keys over three random policies (one with super-block codebooks), codebook names in
    random case: generated Python == Policy.select == C header, answers and refusals alike."""
    print(f"seed {seed}")
    policy = random_policy(seed, **({"codebooks": codebooks} if codebooks else {}))
    assert_module_policy_and_header_agree(policy, seed, 50_000, tmp_path, super_blocks=bool(codebooks))


def test_compact_module_policy_and_header_agree(compact_policy, tmp_path):
    """The compact fallback (trained on the fixture corpus, random overlays added): 100,000 seeded keys,
    generated Python == Policy.select == C header."""
    assert compact_policy.compact is not None
    print("seed 21")
    assert_module_policy_and_header_agree(compact_policy, 21, 100_000, tmp_path)


def test_compact_negative_control(compact_policy, tmp_path):
    """A launch model leaf moved changes some decisions of the rendered module, so the agreement test can fail."""
    from dataclasses import replace

    print("seed 22")
    launch = compact_policy.compact.launch
    (levels, leaves), *rest = launch.trees
    moved = replace(launch, trees=((levels, tuple(v + (1 << 40) * (i % 2) for i, v in enumerate(leaves))), *rest))
    perturbed = replace(compact_policy, compact=replace(compact_policy.compact, launch=moved))
    module = load_module(generate.render(perturbed, GOLDEN_INVENTORIES)[bundle.MODULE], tmp_path)
    keys = [key for key in random_keys(compact_policy, np.random.default_rng(22), 3000) if not refused(key)]
    differ = sum(tuple(module.select(*key)) != tuple(compact_policy.select(*key)) for key in keys)
    assert differ > 0, "a perturbed leaf must change some decision"


def assert_module_policy_and_header_agree(policy, seed: int, count: int, tmp_path: Path,
                                          super_blocks: bool = False) -> None:
    """`count` seeded keys (random_keys): the rendered module and header answer as Policy.select, refusals alike."""
    rendered = generate.render(policy, GOLDEN_INVENTORIES)
    module = load_module(rendered[bundle.MODULE], tmp_path)
    keys = random_keys(policy, np.random.default_rng(seed), count)
    sources = set()
    py = []
    for key in keys:
        if refused(key):
            with pytest.raises(InputError):
                policy.select(*key)
            with pytest.raises(ValueError):
                module.select(*key)
            py.append("error -2")
            continue
        want = policy.select(*key)
        got = module.select(*key)
        assert tuple(got) == tuple(want), f"seed {seed} key {key}: module {got}, policy {want}"
        sources.add(want.source)
        py.append(f"{want.candidate} {want.identity} {want.source}")
    assert sources == {"overlay", "fallback"}, "the keys must reach both overlays and the fallback"
    beyond = sum(bool(registry.shape_error(*key[1:4])) for key in keys)
    assert 0.2 < beyond / len(keys) < 0.6, "keys on both sides of the plane limit"
    assert any(key[0] != key[0].lower() for key in keys) and any(key[0] == key[0].lower() for key in keys)
    if super_blocks:  # super-block keys on both sides of the K rule
        split = [key for key in keys if key[0].lower() in ("q4_k", "q5_k", "q6_k", "iq4_xs")]
        assert sum(bool(k_error(key[0], key[3])) for key in split) > 1000
        assert sum(not refused(key) for key in split) > 1000
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH: the header half of this test needs one")
    c = c_select(rendered[bundle.HEADER], keys, tmp_path)
    for key, want, got in zip(keys, py, c, strict=True):
        assert got == want, f"seed {seed} key {key}: C header {got}, policy {want}"


def test_validity_rule_matches_registry(tmp_path):
    """The rendered validity rule and identity function equal kernels.registry's on random (M, N, K)."""
    module = load_module(generate.render(random_policy(3), GOLDEN_INVENTORIES)[bundle.MODULE], tmp_path)
    rng = np.random.default_rng(3)
    for _ in range(20_000):
        m, n, k = int(rng.integers(1, 40)), int(rng.integers(1, 5000)), 32 * int(rng.integers(1, 600))
        for i, cand in enumerate(CANDIDATES):
            assert module._valid(i, m, n, k) == cand.valid(m, n, k), (cand.id, m, n, k)
            assert module._identity_of(k // 32, cand.ksplit) == cand.identity(k), (cand.id, k)


def test_invalid_arguments_refused_by_module_and_header(tmp_path):
    policy = random_policy(4)
    rendered = generate.render(policy, GOLDEN_INVENTORIES)
    module = load_module(rendered[bundle.MODULE], tmp_path)
    for bad in [("q9_9", 1, 8, 32, "graph"), ("q4_0", 0, 8, 32, "graph"), ("q4_0", 1, 8, 48, "graph"),
                ("q4_0", 1, 8, 32, "lazy"), ("q4_0", True, 8, 32, "graph"), ("q4_0", 1, 1 << 22, 32 << 10, "graph"),
                ("q4_0", 1 << 22, 8, 32 << 10, "graph")]:
        with pytest.raises(ValueError):
            module.select(*bad)
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH")
    bad_c = [("q9_9", 1, 8, 32, "graph"), ("q4_0", 0, 8, 32, "graph"), ("q4_0", 1, 8, 48, "graph"),
             ("q4_0", 1, 1 << 31, 32, "graph"), ("q4_0", 1, 1 << 22, 32 << 10, "graph"),
             ("q4_0", 1 << 22, 8, 32 << 10, "graph")]
    assert c_select(rendered[bundle.HEADER], bad_c, tmp_path) == ["error -1"] + ["error -2"] * 5
    below = ("q4_0", 1, (1 << 22) - 1, 32 << 10, "graph")  # 2^10 blocks below the limit: answered
    assert c_select(rendered[bundle.HEADER], [below], tmp_path)[0] != "error -2"
    assert module.select(*below) == policy.select(*below)


def test_codebook_names_and_super_blocks_agree_in_python_and_c(tmp_path):
    """Issue 50 (3, 1f): the generated select took only "q4_0" (ValueError for the GGUF type name "Q4_0") and
    answered q4_k at K=4128. Now Policy.select, the module and the header (through its name -> index helper)
    take any case and refuse a K that splits a super-block, alike; a name folded only outside ASCII is refused."""
    policy = random_policy(7, codebooks=("iq4_xs", "q4_0", "q4_k"), shapes=((4096, 4096),), overlays=4, depth=3)
    rendered = generate.render(policy, GOLDEN_INVENTORIES)
    module = load_module(rendered[bundle.MODULE], tmp_path)
    answered = [("Q4_K", 1, 4096, 4096, "graph"), ("q4_K", 16, 4096, 4096, "eager"),
                ("IQ4_xs", 3, 14336, 4096, "graph"), ("Q4_0", 1, 4096, 4128, "graph"), ("q4_0", 5, 100, 96, "eager")]
    shapes = [("q4_k", 1, 4096, 4128, "graph"), ("IQ4_XS", 2, 4096, 288, "graph"), ("Q4_K", 1, 64, 32, "eager")]
    names = [("q6_k", 1, 4096, 4096, "graph"), ("Q4_\u212a", 1, 4096, 4096, "graph"), ("", 1, 64, 64, "graph"),
             ("q4_0 ", 1, 64, 64, "graph")]
    expected = []
    for key in answered:
        want = policy.select(*key)
        assert tuple(module.select(*key)) == tuple(want) == tuple(policy.select(key[0].lower(), *key[1:]))
        expected.append(f"{want.candidate} {want.identity} {want.source}")
    for key in shapes:
        unit = "256, the super-block of " + ("Q4_K" if key[0].lower() == "q4_k" else "IQ4_XS")
        for select in (policy.select, module.select):
            with pytest.raises(ValueError, match=f"^K={key[3]} is not a multiple of {unit}$"):
                select(*key)
    for key in names:
        for select in (policy.select, module.select):
            with pytest.raises(ValueError, match="codebook"):
                select(*key)
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH: the header half of this test needs one")
    keys = answered + shapes + names[:2]  # the C driver reads names with scanf("%s"): no empty or spaced ones
    assert c_select(rendered[bundle.HEADER], keys, tmp_path) == expected + ["error -2"] * 3 + ["error -1"] * 2


def test_render_is_deterministic_and_matches_golden(tmp_path):
    """Same policy -> same bytes (twice, and against tests/golden/). Regenerate the golden files after an
    intended template change with GEMV_DISPATCH_UPDATE_GOLDEN=1."""
    policy = random_policy(5, codebooks=("q4_0", "q8_0"), shapes=((4096, 4096), (1000, 14336)), overlays=6,
                           depth=3)
    first = generate.render(policy, GOLDEN_INVENTORIES)
    assert first == generate.render(policy, GOLDEN_INVENTORIES)
    if os.environ.get("GEMV_DISPATCH_UPDATE_GOLDEN"):
        for name, data in first.items():
            (GOLDEN / name).write_bytes(data)
    for name, data in first.items():
        assert (GOLDEN / name).read_bytes() == data, f"{name} differs from tests/golden/{name}"


def test_a_changed_policy_changes_the_bytes():
    """Negative control for the golden test: one overlay more is different bytes."""
    a = random_policy(5, codebooks=("q4_0", "q8_0"), shapes=((4096, 4096), (1000, 14336)), overlays=6, depth=3)
    b = random_policy(5, codebooks=("q4_0", "q8_0"), shapes=((4096, 4096), (1000, 14336)), overlays=7, depth=3)
    assert generate.render(a, GOLDEN_INVENTORIES) != generate.render(b, GOLDEN_INVENTORIES)
