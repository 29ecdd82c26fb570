"""Code generation (docs/policy.md §8): a policy rendered as a standard-library Python module and a C99 header.

`render(policy, ...)` returns {file name: bytes} for dispatch_table.py and dispatch_table.h, byte-for-byte
deterministic for the same policy, tool version and inventory digest. What is rendered is the policy itself,
not precomputed answers, so `select` stays total: the candidates table, both fallback trees as node arrays
walked node by node, the overlays, the registry's validity rule, the identity function and the shape
features (dispatch.learn.features), each re-implemented with integer operations only. The C header uses int64 and
accepts M, N, K up to 2^31 - 1, where every intermediate (N·K·block bytes, 64·N, ...) stays below 2^63.

Order of work, because a certificate binds the module's digest: `render` -> `certify.certify(policy,
rendered, runner)` -> `write(folder, rendered, certificate)`. `generate` is that for the command line: it
renders again and refuses a certificate that does not bind the rendered bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from ...kernels import registry
from ...kernels.codebooks import formats_of, get
from ...kernels.errors import BLOCK, InputError
from .. import __version__
from ..common.contract import MODES
from ..common.digests import sha256
from ..common.files import read_input, write_files
from ..common.gpu import gpu_slug
from ..learn import compact, features
from ..learn.policy import CANONICAL_WIDE, IDENTITIES, Policy, canonical_kpar
from .bundle import CERTIFICATE, HEADER, MODULE, POLICY, certificate_bytes, read_certificate
from .certify import inventories_digest, policy_digests

FAMILIES = ("wide", "direct", "kpar")
# The shape features the templates implement, in dispatch.learn.features order. A policy whose trees use a feature
# the templates do not know is refused (render) rather than rendered wrong.
RENDERED_IDENTITY_FEATURES = ("block_bytes", "asymmetric", "high_bits", "table", "n", "k", "nk", "weight_kib",
                              "n_per_k_x64", "k_per_n_x64", "waves_x64")
RENDERED_LAUNCH_FEATURES = (*RENDERED_IDENTITY_FEATURES, "identity", "width", "split_waves_x64", "m", "m_tile",
                            "mode")
C_MAX_DIM = 2**31 - 1


@dataclass(frozen=True)
class RenderedTree:
    nodes: list[tuple[int, int, int, int, int]]  # feature index into the rendered feature vector
    leaves: list[list[int]]  # identities, or candidate indexes into CANDIDATES


def _tree(tree: Any, order: tuple[str, ...], as_index: Mapping[Any, int] | None) -> RenderedTree:
    """A policy tree with its feature indexes mapped onto `order` (the vector the generated code computes)."""
    remap = [order.index(name) for name in tree.features]
    nodes = [(-1 if f == -1 else remap[f], t, left, right, leaf) for f, t, left, right, leaf in tree.nodes]
    leaves = [[as_index[c] if as_index else c for c in leaf] for leaf in tree.leaves]
    return RenderedTree(nodes, leaves)


# The compact fallback's features the templates implement (dispatch.learn.compact order), checked as above.
RENDERED_COMPACT_IDENTITY = ("lg_wbytes", "lg_n", "lg_k", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                             "split", "lg_width", "lg_ctas", "waves_x64", "lg_bytes_per_cta")
RENDERED_COMPACT_LAUNCH = ("lg_wbytes", "lg_n", "lg_k", "lg_m", "bpw_x64", "asymmetric", "high_bits", "table",
                           "superblock", "family", "split", "lg_width", "threads", "cta_threads", "cpt", "mma_tiles",
                           "staged", "tile", "passes", "lg_ctas", "waves_x64", "whole_waves", "last_fill_x64",
                           "lg_bytes_per_cta", "lg_outputs_per_cta", "lg_bytes_passes", "mode")
COMPACT_LANES = 8  # options the C header scores together: each tree level one compare over a row of lanes


def _c_int(v: int) -> str:
    """An int64 literal: LL beyond int32 (C99 gives an unsuffixed literal the first type that holds it, but an
    explicit suffix keeps -pedantic quiet on every platform)."""
    return f"{v}LL" if not -(1 << 31) < v < (1 << 31) - 1 else str(v)


def _compact_model(model: compact.CompactModel, tag: str) -> dict[str, Any]:
    """One compact model as the templates spell it: per tree the leaf index as an expression of compares shifted
    into place (the features and thresholds as immediates: no walk loop, about a third of a walk's time in Python,
    and in C a compare over a row of lanes that -O2 vectorizes)."""
    d = model.depth

    def index(x: str, levels: tuple[tuple[int, int], ...], c: bool) -> str:
        return " | ".join(f"(({x.format(f)} > {_c_int(v) if c else v}) << {d - 1 - i})"
                          for i, (f, v) in enumerate(levels)) if d else "0"

    leaves = [list(lv) for _, lv in model.trees]
    fits32 = all(-(1 << 31) < v < (1 << 31) - 1 for lv in leaves for v in lv)
    return {
        "tag": tag, "depth": d, "trees": len(model.trees), "leaves": leaves or [[0] * (1 << d)],
        "c_leaf_type": "int32_t" if fits32 else "int64_t",
        "py_terms": [f"_{tag.upper()}_V[{t}][{index('x[{}]', levels, False)}]"
                     for t, (levels, _) in enumerate(model.trees)] or ["0"],
        "c_index": [index("X[{}][j0 + j]", levels, True) for levels, _ in model.trees],
    }


def _feature_type(fallback: compact.Compact) -> tuple[str, int, int]:
    """(C type, min, max) of the narrowest int type the header may store features in: features are computed in
    int64 and clamped into [min, max], which keeps every compare exact while each threshold t has min <= t < max
    (x > max > t, and x < min <= t, compare as x itself). Narrow rows compare more options per vector instruction:
    int16 is what the study timed."""
    thresholds = [t for model in (fallback.identity, fallback.launch) for levels, _ in model.trees for _, t in levels]
    for bits in (16, 32):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if all(lo <= t < hi for t in thresholds):
            return f"int{bits}_t", lo, hi
    return "int64_t", -(1 << 63), (1 << 63) - 1


def _compact(policy: Policy, codebooks: list[str]) -> dict[str, Any] | None:
    """What the templates need of a compact fallback, or None for the trees."""
    if policy.compact is None:
        return None
    if (compact.IDENTITY_FEATURES, compact.LAUNCH_FEATURES) != (RENDERED_COMPACT_IDENTITY, RENDERED_COMPACT_LAUNCH):
        raise InputError("dispatch.learn.compact changed: the templates implement "
                         f"{RENDERED_COMPACT_LAUNCH}, the policy code {compact.LAUNCH_FEATURES}")
    traits = [compact.Traits.of(cb) for cb in codebooks]
    cands = registry.CANDIDATES
    return {
        "identity": _compact_model(policy.compact.identity, "cid"),
        "launch": _compact_model(policy.compact.launch, "cla"),
        "identities": list(IDENTITIES),
        # codebook -> weights per block, block bytes, asymmetric, high bits, table (compact.Traits)
        "traits": [(t.weights, t.block_bytes, t.asymmetric, t.high_bits, t.table) for t in traits],
        # per candidate: family, ksplit, threads, cta threads, cpt, mma_tiles, staged, outputs per CTA,
        # 64·log2(outputs per CTA), the row tile cap min(ROW_TILES[-1], MAX_ACCUMULATORS // cpt)
        "candidates": [(FAMILIES.index(c.family), c.ksplit, c.threads,
                        compact.cta_threads(c), c.cpt, c.mma_tiles, int(c.staged),
                        c.outputs_per_cta, compact.ilog2(c.outputs_per_cta),
                        min(registry.ROW_TILES[-1], registry.MAX_ACCUMULATORS // c.cpt)) for c in cands],
        "mma_rows": registry.MMA_ROWS,
        "mma_tiles": registry.MMA_ROW_TILES,
        "lanes": COMPACT_LANES,
        "cache_slots": 256,
        "feature_type": _feature_type(policy.compact),
        "max_options": -(-max(len(cands), len(IDENTITIES)) // COMPACT_LANES) * COMPACT_LANES,
    }


def _plain(text: str) -> str:
    """`text` if it is printable ASCII (safe inside a Python or C literal and a comment), else InputError."""
    if not (text.isascii() and text.isprintable()):
        raise InputError(f"{text!r} is not printable ASCII; it cannot be rendered into generated code")
    return text


def _c_string(text: str) -> str:
    return '"' + _plain(text).replace("\\", "\\\\").replace('"', '\\"').replace("?", "\\?") + '"'


def _py_tuple(items: list[Any]) -> str:
    """A Python tuple literal of ints: (1,) for one item, () for none."""
    return "(" + ", ".join(str(i) for i in items) + ("," if len(items) == 1 else "") + ")"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gemv_dispatch.dispatch.table", "templates"),
        undefined=jinja2.StrictUndefined,  # a missing value is an error, never an empty string in code
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # code, not HTML
    )
    env.filters.update(c_string=_c_string, c_comment=lambda t: _plain(t).replace("*/", "* /"), py_tuple=_py_tuple,
                       py_string=lambda t: json.dumps(_plain(t)))
    return env


def context(policy: Policy, inventories: str) -> dict[str, Any]:
    """Everything the templates render, as plain sorted data (the source of determinism)."""
    if (features.IDENTITY_FEATURES, features.LAUNCH_FEATURES) != (RENDERED_IDENTITY_FEATURES,
                                                                     RENDERED_LAUNCH_FEATURES):
        raise InputError("dispatch.learn.features changed: the templates implement "
                         f"{RENDERED_LAUNCH_FEATURES}, the policy code {features.LAUNCH_FEATURES}")
    candidates = registry.CANDIDATES
    index = {c.id: i for i, c in enumerate(candidates)}
    codebooks = list(policy.codebooks)
    cb_index = {cb: i for i, cb in enumerate(codebooks)}
    mode_index = {m: i for i, m in enumerate(MODES)}
    source = policy.source
    digests = policy_digests(policy, inventories)
    return {
        "tool_version": __version__,
        "gpu_name": str(source.get("gpu_name")),
        "gpu_slug": gpu_slug(str(source.get("gpu_name"))),
        "sm_count": policy.sm_count,
        "digests": digests,
        "block": BLOCK,
        "scale": features.SCALE,
        "wave_outputs": features.WAVE_OUTPUTS,
        "row_tile_cap": registry.ROW_TILES[-1],
        "max_accumulators": registry.MAX_ACCUMULATORS,
        "mma_outputs": registry.MMA_OUTPUTS,
        "max_cta_threads": registry.MAX_CTA_THREADS,
        "shared_limit": registry.SHARED_MEMORY_LIMIT,
        "staged_block_bytes": registry.STAGED_BLOCK_BYTES,
        "modes": list(MODES),
        "families": list(FAMILIES),
        "identity_features": list(RENDERED_IDENTITY_FEATURES),
        "launch_features": list(RENDERED_LAUNCH_FEATURES),
        "codebooks": [(cb, [features.codebook_features(cb)[f] for f in features.CODEBOOK_FEATURES])
                      for cb in codebooks],
        # What select takes for a codebook: its execution key or the GGUF type name of a format of that key, in
        # any (ASCII) case; lower-case names with the index of their key, sorted. And per key, the weights of a
        # GGUF block (K must be a multiple: 256 for a super-block format) and the formats it stands for.
        "codebook_names": sorted({(name, i) for i, cb in enumerate(codebooks)
                                  for name in (cb, *(f.lower() for f in formats_of(cb)))}),
        "codebook_blocks": [(max(get(f).weights for f in formats_of(cb)), "/".join(formats_of(cb)))
                            for cb in codebooks],
        "candidates": [(c.id, FAMILIES.index(c.family), c.ksplit, c.threads, c.cpt, c.mma_tiles, int(c.staged))
                       for c in candidates],
        "canonical_wide": index[CANONICAL_WIDE],
        # canonical(i, k) for i > 1: the dp4a kpar t128 c1 launches, in registry order (policy.canonical).
        "canonical_kpar": [i for i, c in enumerate(candidates) if canonical_kpar(c)],
        "identity_tree": policy.identity_tree and _tree(policy.identity_tree, RENDERED_IDENTITY_FEATURES, None),
        "launch_tree": policy.launch_tree and _tree(policy.launch_tree, RENDERED_LAUNCH_FEATURES, index),
        "compact": _compact(policy, codebooks),
        "identity_overlays": sorted((cb_index[cb], n, k, ident)
                                    for (cb, n, k), ident in policy.identity_overlays.items()),
        "launch_overlays": sorted((cb_index[cb], m, n, k, mode_index[mode], index[cand])
                                  for (cb, m, n, k, mode), cand in policy.launch_overlays.items()),
        "c_max_dim": C_MAX_DIM,
        "max_plane_entries": registry.MAX_PLANE_ENTRIES,
    }


def render(policy: Policy, inventories: str | None = None) -> dict[str, bytes]:
    """{MODULE: bytes, HEADER: bytes} for `policy`; `inventories` defaults to the shipped inventories' digest."""
    ctx = context(policy, inventories or inventories_digest())
    env = _environment()
    return {MODULE: env.get_template("dispatch_table.py.j2").render(ctx).encode(),
            HEADER: env.get_template("dispatch_table.h.j2").render(ctx).encode()}


def check_binding(rendered: Mapping[str, bytes], cert: Mapping[str, Any], where: str) -> None:
    """InputError unless the certificate passed and binds exactly these rendered files."""
    bound = cert.get("digests", {}).get("artifacts", {})
    want = {name: sha256(data) for name, data in rendered.items()}
    if bound != want:
        raise InputError(f"{where}: the certificate was made for other module bytes (another policy, tool version "
                         f"or inventories): certify this policy again")
    if cert.get("passed") is not True:
        failed = sorted(n for n, c in cert.get("checks", {}).items() if c.get("result") == "fail")
        raise InputError(f"{where}: the certificate records failed checks: {', '.join(failed) or 'incomplete'}")


def write(folder: Path, rendered: Mapping[str, bytes], cert: Mapping[str, Any], policy: Policy) -> Path:
    """Write the rendered files, the certificate and the policy (policy.json) into `folder`, created with its
    missing parents: every file staged before the first is replaced (common.files.write_files), and a folder
    this call made is removed again when writing fails, so a failure leaves the files as they were."""
    check_binding(rendered, cert, str(folder))
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: a file; name the folder to write the table into")
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        write_files(folder, {**rendered, CERTIFICATE: certificate_bytes(cert), POLICY: policy.to_bytes()})
    except BaseException:
        for path in made:  # deepest first; stops at the first that another writer has filled meanwhile
            try:
                path.rmdir()
            except OSError:
                break
        raise
    return folder


def generate(policy: Policy, cert_path: Path, folder: Path) -> Path:
    """`gemv-dispatch generate`: render `policy`, check that the certificate binds the result, write the table
    and the policy beside it (as `tune` does)."""
    data = read_input(cert_path, "certificate", " (run `gemv-dispatch certify` first)")
    cert = read_certificate(data, str(cert_path))
    return write(folder, render(policy), cert, policy)
