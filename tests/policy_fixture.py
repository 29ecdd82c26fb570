"""Seeded random policies for the generate / certify / install tests: the dispatch stages must work for any
valid policy, not only for what `train` happens to produce, so the trees, leaves and overlays here are random
(deep trees over shuffled feature lists, leaves naming unavailable identities and unfit candidates, overlays
that do not fit some M) while staying valid per docs/policy.md."""

from __future__ import annotations

import numpy as np
from gemv_dispatch.dispatch import __version__
from gemv_dispatch.dispatch.learn.features import IDENTITY_FEATURES, LAUNCH_FEATURES, identity_features, launch_features
from gemv_dispatch.dispatch.learn.policy import DEFAULT_PROFILE, IDENTITIES, Policy, Tree, canonical
from gemv_dispatch.kernels import digests, program
from gemv_dispatch.kernels.registry import CANDIDATES

FAKE_GPU = "Fake GPU 9000"  # tests/corpus_fixture.py's GPU
SM_COUNT = 132
MODES = ("graph", "eager")


def random_shape(rng: np.random.Generator) -> tuple[int, int]:
    """(N, K) from 1 to ~2^20 x ~2^20, log-uniform, K a multiple of 32."""
    n = int(np.exp(rng.uniform(0, np.log(1 << 20))))
    k = 32 * int(np.exp(rng.uniform(0, np.log(1 << 15))))
    return max(n, 1), max(k, 32)


def _tree(rng: np.random.Generator, names: tuple[str, ...], values: list[dict[str, int]], leaf_choices: list,
          depth: int) -> Tree:
    features = [str(f) for f in rng.permutation(names)[: int(rng.integers(1, len(names) + 1))]]
    nodes: list[list[int]] = []
    leaves: list[list] = []

    def grow(level: int) -> int:
        i = len(nodes)
        nodes.append([])
        if level == depth or rng.random() < 0.2:
            size = int(rng.integers(0, 5))
            leaves.append([leaf_choices[j] for j in rng.permutation(len(leaf_choices))[:size]])
            nodes[i] = [-1, 0, 0, 0, len(leaves) - 1]
            return i
        f = int(rng.integers(0, len(features)))
        threshold = int(values[int(rng.integers(0, len(values)))][features[f]])
        left = grow(level + 1)
        right = grow(level + 1)
        nodes[i] = [f, threshold, left, right, 0]
        return i

    grow(0)
    return Tree(tuple(features), tuple(tuple(n) for n in nodes), tuple(tuple(leaf) for leaf in leaves))


def random_policy(seed: int, codebooks: tuple[str, ...] = ("iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"),
                  shapes: tuple[tuple[int, int], ...] = (), overlays: int = 40, depth: int = 6,
                  gpu_name: str = FAKE_GPU, corpus_sha256: str = "0" * 64) -> Policy:
    """A valid policy with random trees and overlays; `shapes` (N, K) are its trained shapes for every codebook
    (random ones when empty). Round-tripped through its bytes, so it carries its digest."""
    rng = np.random.default_rng(seed)
    shapes = shapes or tuple(random_shape(rng) for _ in range(6))
    samples = [random_shape(rng) for _ in range(64)]
    ident_values = [identity_features(str(rng.choice(codebooks)), n, k, SM_COUNT) for n, k in samples]
    launch_values = [launch_features(str(rng.choice(codebooks)), int(rng.choice(IDENTITIES)), int(rng.integers(1, 40)),
                                     n, k, str(rng.choice(MODES)), SM_COUNT) for n, k in samples]
    identity_tree = _tree(rng, IDENTITY_FEATURES, ident_values, list(IDENTITIES), depth)
    launch_tree = _tree(rng, LAUNCH_FEATURES, launch_values, [c.id for c in CANDIDATES], depth)
    identity_overlays = {}
    launch_overlays = {}
    keys = [(cb, n, k) for cb in codebooks for n, k in shapes]
    for _ in range(overlays):
        cb, n, k = keys[int(rng.integers(0, len(keys)))]
        available = [i for i in IDENTITIES if canonical(i, n, k) is not None]
        identity_overlays[(cb, n, k)] = int(rng.choice(available))
        m = int(rng.choice([1, 2, 4, 5, 16, 31]))
        launch_overlays[(cb, m, n, k, str(rng.choice(MODES)))] = str(rng.choice([c.id for c in CANDIDATES]))
    source = {"corpus": "fake-gpu-9000", "corpus_manifest_sha256": corpus_sha256, "gpu_name": gpu_name,
              "sm_count": SM_COUNT, "kernel_digest": program.digest(), "code_digest": digests.code_digest(),
              "tool_version": __version__}
    options = {"profile": {str(m): w for m, w in DEFAULT_PROFILE.items()}, "noise_rel": 0.02}
    policy = Policy(source, options, tuple(sorted(codebooks)), identity_tree, launch_tree, identity_overlays,
                    launch_overlays, tuple(sorted((cb, n, k) for cb, n, k in keys)))
    return Policy.from_bytes(policy.to_bytes(), f"random_policy({seed})")


def trained_compact_policy(root, seed: int = 5):
    """A compact fallback trained on the fixture corpus (tests/corpus_fixture.py; small models, so a test runs in
    seconds) with random_policy's overlays added, so that keys reach both the overlays and the fallback (trained on
    the fixture, the compact fallback needs no overlay). Round-tripped through its bytes."""
    from dataclasses import replace

    from corpus_fixture import build_corpus
    from gemv_dispatch.dispatch.learn.compact import CompactParams
    from gemv_dispatch.dispatch.learn.train import TrainOptions, train
    from gemv_dispatch.dispatch.measure.corpus import load

    params = CompactParams(launch_trees=30, identity_trees=20, teacher_trees=30, teacher_depth=6, grid=40)
    trained, _ = train(load(build_corpus(root)), TrainOptions(fallback="compact", compact=params))
    overlays = random_policy(seed, codebooks=trained.codebooks)
    policy = replace(trained, identity_overlays=overlays.identity_overlays, launch_overlays=overlays.launch_overlays)
    return Policy.from_bytes(policy.to_bytes())
