"""Speed of a generated table's `select`, on the CPU: the Python module and the C header.

    python bench/select_speed.py [TABLE_DIR] [--keys N] [--json]

TABLE_DIR defaults to the committed generated/nvidia-h200/. Keys are seeded random valid ones: a served codebook,
M in {1..16, 31}, N in 1..262144, K a multiple of 256 up to 65536 (valid for every codebook), a mode. Measured:
  python uncached  select() on N distinct keys, per key                 budget <= 5 ms
  python cached    a per-key cache (what the runtime keeps) hit, per key budget <= 1 us
  c uncached       gemv_dispatch_select() compiled (cc -O2) in a tiny    budget <= 5 us
                   driver, on the same kind of keys, per key
  c identity       a compact table only: gemv_dispatch_select_cached, keys of 64 shapes, the identity cache warm
  cached
  module size      dispatch_table.py bytes                              budget <= 4 MB
The C driver needs a C compiler (cc, gcc or clang on PATH); without one its line says so.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MS = (*range(1, 17), 31)
BUDGETS = {"python_uncached_us": 5000.0, "python_cached_us": 1.0, "c_uncached_us": 5.0, "module_mb": 4.0}

DRIVER = r"""
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "dispatch_table.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }

int main(int argc, char **argv) {
    long count = atol(argv[1]);
    static const int ms[17] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 31};
    int64_t (*keys)[5] = malloc(sizeof(*keys) * count);
    for (long i = 0; i < count; i++) {
        keys[i][0] = next() % GEMV_DISPATCH_CODEBOOK_COUNT;
        keys[i][1] = ms[next() % 17];
        keys[i][2] = 1 + next() % 262144;
        keys[i][3] = 256 * (1 + next() % 256);
        keys[i][4] = next() % 2;
    }
    gemv_dispatch_choice out = {0, 0, 0};
    long sum = 0, bad = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < count; i++) {
        int rc = gemv_dispatch_select((int)keys[i][0], keys[i][1], keys[i][2], keys[i][3], (int)keys[i][4], &out);
        if (rc != GEMV_DISPATCH_OK) bad++;
        sum += out.candidate;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("%.6f %ld %ld", ns / count / 1e3, bad, sum);
#ifdef GEMV_DISPATCH_CACHE_SLOTS
    /* A compact table's identity cache: the same kind of keys, their (codebook, N, K) from a pool of 64 shapes (a
     * model's few weight shapes), M and mode free; the cache warmed by one pass, then timed. */
    {
        static gemv_dispatch_identity_cache cache;
        for (long i = 0; i < count; i++) {
            long j = (long)(next() % 64);
            keys[i][0] = keys[j][0];
            keys[i][2] = keys[j][2];
            keys[i][3] = keys[j][3];
        }
        for (long i = 0; i < count; i++)
            gemv_dispatch_select_cached(&cache, (int)keys[i][0], keys[i][1], keys[i][2], keys[i][3], (int)keys[i][4],
                                        &out);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < count; i++) {
            gemv_dispatch_select_cached(&cache, (int)keys[i][0], keys[i][1], keys[i][2], keys[i][3], (int)keys[i][4],
                                        &out);
            sum += out.candidate;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
        printf(" %.6f", ns / count / 1e3);
    }
#endif
    printf("\n");
    return 0;
}
"""


def load_module(folder: Path) -> Any:
    spec = importlib.util.spec_from_file_location("bench_dispatch_table", folder / "dispatch_table.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def random_keys(codebooks: list[str], count: int, seed: int = 0) -> list[tuple[str, int, int, int, str]]:
    rng = random.Random(seed)
    return [(rng.choice(codebooks), rng.choice(MS), rng.randint(1, 262144), 256 * rng.randint(1, 256),
             rng.choice(("graph", "eager"))) for _ in range(count)]


def python_speed(folder: Path, count: int) -> dict[str, float]:
    module = load_module(folder)
    keys = random_keys(sorted(module.CODEBOOK_FEATURES), count)
    start = time.perf_counter()
    for key in keys:
        module.select(*key)
    uncached = (time.perf_counter() - start) / count * 1e6
    cached = functools.cache(module.select)
    for key in keys:
        cached(*key)
    rounds = 20
    start = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            cached(*key)
    return {"python_uncached_us": uncached, "python_cached_us": (time.perf_counter() - start) / (rounds * count) * 1e6}


def c_speed(folder: Path, count: int) -> dict[str, Any]:
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        return {"c_note": "no C compiler on PATH (cc, gcc, clang): the C select was not timed"}
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "driver.c", Path(tmp) / "driver"
        source.write_text(DRIVER)
        built = subprocess.run([compiler, "-O2", "-std=c99", "-I", str(folder), str(source), "-o", str(binary)],
                               capture_output=True, text=True, check=False)
        if built.returncode:
            return {"c_note": f"{compiler} could not build the driver over {folder / 'dispatch_table.h'}: "
                              f"{(built.stderr.strip().splitlines() or ['no message'])[0]}"}
        per_key, bad, _, *cached = subprocess.run([str(binary), str(count * 10)], check=True, capture_output=True,
                                                  text=True).stdout.split()
    out: dict[str, Any] = {"c_uncached_us": float(per_key), "c_refused_keys": int(bad), "c_compiler": compiler}
    if cached:  # a compact table: gemv_dispatch_select_cached over 64 shapes, the identity cache warm
        out["c_identity_cached_us"] = float(cached[0])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", nargs="?", type=Path, default=REPO / "generated" / "nvidia-h200")
    parser.add_argument("--keys", type=int, default=2000, help="distinct keys timed (C: ten times as many)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (args.table / "dispatch_table.py").is_file():
        print(f"error: {args.table}: no dispatch_table.py here", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"table": str(args.table), "keys": args.keys,
                              "module_mb": (args.table / "dispatch_table.py").stat().st_size / 1e6}
    result |= python_speed(args.table, args.keys) | c_speed(args.table, args.keys)
    result["within_budget"] = {name: result[name] <= limit for name, limit in BUDGETS.items() if name in result}
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0
    for name, limit in BUDGETS.items():
        if name in result:
            unit = "MB" if name.endswith("mb") else "us per key"
            verdict = "within" if result[name] <= limit else "OVER"
            print(f"{name:<20} {result[name]:>10.3f} {unit:<11} budget {limit:g} ({verdict})")
    if "c_identity_cached_us" in result:
        cached = result["c_identity_cached_us"]
        print(f"{'c_identity_cached_us':<20} {cached:>10.3f} us per key  (64 shapes, cache warm)")
    if "c_note" in result:
        print(result["c_note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
