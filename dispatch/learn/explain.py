"""Why a shape gets its kernel: the policy's pick, who decided, the measured neighbours, the predicted time."""

from __future__ import annotations

import math
from typing import Any

from ...kernels.codebooks import formats_of, get
from ..measure.corpus import Corpus
from .policy import Policy, check_arguments
from .train import Measurements, TimeModel, serving

NEIGHBOURS = 5


def explain(policy: Policy, corpus: Corpus, codebook: str, m: int, n: int, k: int, mode: str) -> dict[str, Any]:
    """The pick for (codebook, M, N, K, mode) with its evidence (a JSON-ready dict).

    neighbours: the measured cells of the same codebook and mode nearest in (log N, log K, log M), each with
    the pick's identity's best launch there, the cell's best and their times (µs). predicted_us: the time
    model's estimate for the pick (the measurement if this exact cell was measured); gbps: weight bytes read
    per second at that time."""
    codebook = check_arguments(codebook, m, n, k, mode)
    choice = policy.select(codebook, m, n, k, mode)
    meas = Measurements.from_corpus(corpus)
    predicted = float(TimeModel().fit(meas).predict([(codebook, choice.candidate, m, n, k, mode)])[0])
    book = get(formats_of(codebook)[0])
    weight_bytes = n * (k // book.weights) * book.block_bytes

    def distance(key: tuple[str, int, int, int, str]) -> float:
        return math.dist((math.log2(key[2]), math.log2(key[3]), math.log2(key[1])),
                         (math.log2(n), math.log2(k), math.log2(m)))

    near = sorted((key for key in meas.times if key[0] == codebook and key[4] == mode), key=lambda q: (distance(q), q))
    neighbours = []
    for key in near[:NEIGHBOURS]:
        cell = meas.times[key]
        best = min(cell, key=lambda c: (cell[c], c))
        serve = serving(*key[1:4])
        mine = [c for c in cell if serve.get(c) == choice.identity]
        entry = {"m": key[1], "n": key[2], "k": key[3], "best": best, "best_us": cell[best]}
        if mine:
            pick = min(mine, key=lambda c: (cell[c], c))
            entry |= {"same_identity": pick, "same_identity_us": cell[pick]}
        neighbours.append(entry)
    measured = (codebook, m, n, k, mode) in meas.times
    return {"codebook": codebook, "m": m, "n": n, "k": k, "mode": mode, "candidate": choice.candidate,
            "identity": choice.identity, "source": choice.source, "measured": measured,
            "predicted_us": predicted, "gbps": weight_bytes / predicted / 1e3, "neighbours": neighbours}
