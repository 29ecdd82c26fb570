"""Shape inventories: which GEMV geometries (N, K) real models and the generalization grid need.

W is an N×K matrix (N = output features, K = input features), y = W·x. One inventory per JSON file
under corpus/shapes/, in this format (keys sorted, indent 1, trailing newline):

    {"name": "llama-3.1-8b",                       # unique across all inventory files
     "family": "llama-3.1",                        # hold-out group for evaluation (docs/policy.md §6)
     "source": "meta-llama/Llama-3.1-8B/config.json",
     "config": {"hidden_size": 4096, ...},         # the integer dims the shapes came from (optional)
     "shapes": [{"role": "q", "n": 4096, "k": 4096}, ...]}

A shape may also carry "codebooks": ["Q4_K", "Q6_K"], the GGUF types the model stores it in (written by
`shapes from-gguf`, so a Q4_K_M model yields a mixed-codebook inventory); a shape without it is untyped and
a sweep plan's codebooks apply to it. Files from before the key existed load unchanged.

Rules, checked on load: n and k are integers > 0, k is a multiple of 32 (one quantization block);
codebooks, where given, are distinct formats the tool understands (kernels.codebooks.CODEBOOKS) and k is a
multiple of each one's block (256 weights for super-block formats); a role appears once per file, while
different roles may share one (n, k); names are unique across files.
Model roles: q, k, v, o, the fused qkv, gate, up, the fused gate_up, down and lm_head. The fused roles
are listed because engines that fuse the projections launch one GEMV of that size instead of two/three.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...kernels.codebooks import CODEBOOKS, get
from ...kernels.errors import BLOCK, InputError
from ..common import paths
from ..common.files import write_atomic

ROLES = ("q", "k", "v", "o", "qkv", "gate", "up", "gate_up", "down", "lm_head")
CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)

# The generalization grid spans these ranges; a cell holding more weights than GRID_MAX_ELEMENTS is left
# out because no model in the corpus needs it (the largest, Llama-3.1-70B's lm_head, has 1.05e9) and a
# sweep must pack and hold every cell's weights in memory.
GRID_N = (256, 262144)
GRID_K = (256, 65536)
GRID_MAX_ELEMENTS = 1 << 30
GRID_NAME = "synthetic-grid"

StrPath = str | os.PathLike[str]


@dataclass(frozen=True)
class Shape:
    """One GEMV geometry of one model: W is n×k; `role` says which projection it is."""

    n: int
    k: int
    role: str
    model: str
    family: str
    codebooks: tuple[str, ...] = ()  # sorted GGUF types of the tensors (from-gguf); () = untyped


@dataclass(frozen=True)
class Inventory:
    """The GEMV shapes of one model (or of the synthetic grid), with where they came from."""

    name: str
    family: str
    source: str
    shapes: tuple[Shape, ...]
    config: tuple[tuple[str, int], ...] = field(default=())  # sorted (key, value); a tuple keeps it frozen

    def geometries(self) -> list[tuple[int, int]]:
        """Sorted unique (n, k): the cells a sweep has to measure for this inventory."""
        return sorted({(s.n, s.k) for s in self.shapes})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form documented in this module's docstring."""
        return {
            "name": self.name,
            "family": self.family,
            "source": self.source,
            "config": dict(self.config),
            "shapes": [{"role": s.role, "n": s.n, "k": s.k} | ({"codebooks": list(s.codebooks)} if s.codebooks else {})
                       for s in self.shapes],
        }


def default_inventory_dir() -> Path:
    """The shipped inventories (dispatch.common.paths.shapes_dir)."""
    return paths.shapes_dir()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true would pass as 1 otherwise


def _text(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _codebooks(entry: dict[str, Any], at: str) -> tuple[str, ...]:
    """The optional 'codebooks' of a validated shape entry, canonical names sorted; () when absent."""
    if "codebooks" not in entry:
        return ()
    given = entry["codebooks"]
    if not isinstance(given, list) or not given or not all(isinstance(name, str) for name in given):
        raise InputError(f"{at}: 'codebooks' must be a non-empty list of codebook names, got {given!r}")
    names = []
    for name in given:
        try:
            book = get(name)
        except InputError as err:
            raise InputError(f"{at}: {err}") from None
        if entry["k"] % book.weights:
            raise InputError(f"{at}: k={entry['k']} is not a multiple of {book.weights}, the {book.name} super-block")
        names.append(book.name)
    if len(set(names)) != len(names):
        raise InputError(f"{at}: 'codebooks' lists a codebook twice: {given!r}")
    return tuple(sorted(names))


def inventory_from_dict(data: Any, where: str) -> Inventory:
    """Validate one inventory's JSON object; `where` (a file name) starts every error message."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [key for key in ("name", "family", "source", "shapes") if key not in data]
    if missing:
        raise InputError(f"{where}: missing key(s) {', '.join(missing)}")
    name, family, source = (_text(data, key, where) for key in ("name", "family", "source"))
    config = data.get("config", {})
    if not isinstance(config, dict) or not all(_is_int(v) for v in config.values()):
        raise InputError(f"{where}: 'config' must be an object of integers, got {config!r}")
    entries = data["shapes"]
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{where}: 'shapes' must be a non-empty list")

    shapes: list[Shape] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        at = f"{where}: shapes[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{at}: expected an object with role, n, k, got {entry!r}")
        lacking = [key for key in ("role", "n", "k") if key not in entry]
        if lacking:
            raise InputError(f"{at}: missing key(s) {', '.join(lacking)}")
        role = _text(entry, "role", at)
        at = f"{at} (role {role!r})"
        for key in ("n", "k"):
            if not _is_int(entry[key]) or entry[key] <= 0:
                raise InputError(f"{at}: {key} must be an integer > 0, got {entry[key]!r}")
        if entry["k"] % BLOCK:
            raise InputError(f"{at}: k={entry['k']} is not a multiple of {BLOCK}")
        if role in seen:
            raise InputError(f"{at}: duplicate role, already at shapes[{seen[role]}]")
        seen[role] = i
        shapes.append(Shape(entry["n"], entry["k"], role, name, family, _codebooks(entry, at)))
    return Inventory(name, family, source, tuple(shapes), tuple(sorted(config.items())))


def load_inventory(path: StrPath) -> Inventory:
    """Read and validate one inventory file; any defect raises InputError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such inventory file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: malformed JSON ({err})") from None
    return inventory_from_dict(data, str(path))


def load_inventories(paths_or_dir: StrPath | Iterable[StrPath]) -> list[Inventory]:
    """Load inventory files; a directory stands for its *.json files. Names must be unique."""
    given = [paths_or_dir] if isinstance(paths_or_dir, str | os.PathLike) else list(paths_or_dir)
    files: list[Path] = []
    for item in map(Path, given):
        if item.is_dir():
            found = sorted(item.glob("*.json"))
            if not found:
                raise InputError(f"{item}: no inventory files (*.json) in this directory")
            files.extend(found)
        else:
            files.append(item)
    if not files:
        raise InputError("no inventory files given")

    inventories: list[Inventory] = []
    origin: dict[str, Path] = {}
    for path in files:
        inv = load_inventory(path)
        if inv.name in origin:
            raise InputError(f"{path}: inventory name {inv.name!r} is already used by {origin[inv.name]}")
        origin[inv.name] = path
        inventories.append(inv)
    return inventories


def write_inventory(inv: Inventory, path: StrPath) -> Path:
    """Write `inv` as deterministic JSON, atomically: a reader sees the old file or the new one."""
    path = Path(path)
    text = json.dumps(inv.to_dict(), sort_keys=True, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode("utf-8"))
    return path


def from_config(name: str, family: str, source: str, config: Mapping[str, int]) -> Inventory:
    """The ten projections of a dense GQA transformer block, from its config.json dimensions."""
    lacking = [key for key in CONFIG_KEYS if key not in config]
    if lacking:
        raise InputError(f"{name}: config lacks {', '.join(lacking)}")
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    dims = {
        "q": (q_out, hidden),
        "k": (kv_out, hidden),
        "v": (kv_out, hidden),
        "o": (hidden, q_out),
        "qkv": (q_out + 2 * kv_out, hidden),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }
    shapes = tuple(Shape(n, k, role, name, family) for role, (n, k) in dims.items())
    return Inventory(name, family, source, shapes, tuple(sorted(config.items())))


def _grid_axis(lo: int, hi: int) -> tuple[list[int], list[int]]:
    """Powers of two from lo to hi, and one odd multiple of 32 near each geometric half-octave between.

    The odd multiples (e.g. 352 = 11·32, 2912 = 91·32) are never a multiple of 64, so they leave
    partial tiles and partial K partitions that the power-of-two points never exercise."""
    powers = [1 << e for e in range(lo.bit_length() - 1, hi.bit_length())]
    halves = [(math.isqrt(a * b) // BLOCK | 1) * BLOCK for a, b in itertools.pairwise(powers)]
    return powers, halves


def synthetic_grid() -> Inventory:
    """The log-spaced generalization grid over N in GRID_N and K in GRID_K.

    A quincunx lattice: powers of two crossed with powers of two, and half-octave odd multiples of 32
    crossed with each other, so every point is half an octave (diagonally) from its neighbours at half
    the cost of a full half-octave grid. Cells above GRID_MAX_ELEMENTS weights are left out."""
    n_pow, n_half = _grid_axis(*GRID_N)
    k_pow, k_half = _grid_axis(*GRID_K)
    cells = sorted(
        (n, k)
        for ns, ks in ((n_pow, k_pow), (n_half, k_half))
        for n in ns
        for k in ks
        if n * k <= GRID_MAX_ELEMENTS
    )
    shapes = tuple(Shape(n, k, f"grid_{n}x{k}", GRID_NAME, "synthetic") for n, k in cells)
    config = {"n_min": GRID_N[0], "n_max": GRID_N[1], "k_min": GRID_K[0], "k_max": GRID_K[1],
              "max_elements": GRID_MAX_ELEMENTS}
    return Inventory(GRID_NAME, "synthetic", "dispatch.shapes.synthetic_grid", shapes,
                     tuple(sorted(config.items())))


def write_synthetic_grid(directory: StrPath | None = None) -> Path:
    """Regenerate corpus/shapes/synthetic-grid.json from synthetic_grid() (a test keeps them equal)."""
    directory = Path(directory) if directory is not None else default_inventory_dir()
    return write_inventory(synthetic_grid(), directory / f"{GRID_NAME}.json")


# GGUF tensor base names (blk.<i>.<base>.weight) -> role; `_exps` are 3-D stacks of per-expert matrices.
_GGUF_ROLES = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_qkv": "qkv",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_gate_up": "gate_up",
    "ffn_down": "down",
    "ffn_gate_exps": "expert_gate",
    "ffn_up_exps": "expert_up",
    "ffn_down_exps": "expert_down",
}
_GGUF_BLOCK = re.compile(r"blk\.\d+\.(?P<base>\w+)\.weight")
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})  # unquantized: the geometry counts, untyped


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over `path` (tensor infos; data memory-mapped), or InputError naming the file."""
    import gguf  # heavy import, only needed here

    if path.is_dir():
        raise InputError(f"{path}: a folder, not a GGUF file")
    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise InputError(f"{path}: not a readable GGUF file ({err})") from None


def from_gguf(path: StrPath) -> Inventory:
    """The GEMV shapes of a GGUF model, read from its tensor infos only (no weight is loaded).

    GGUF stores a matrix's dims as ne = [K, N]: ne[0] is the contiguous (input) dim, and
    gguf.GGUFReader's ReaderTensor.shape is that ne list, so n = shape[1], k = shape[0].
    Identical (role, n, k) across layers collapse into one entry carrying the GGUF types of its tensors
    (a Q4_K_M model stores some layers' v and down in Q6_K: one entry, codebooks Q4_K and Q6_K); a role
    that occurs with several geometries (models with per-layer widths) gets one entry per geometry, named
    `role:NxK`. token_embd is not a GEMV, except as the lm_head of a tied model without output.weight.
    Unquantized tensors (F32, F16, BF16, F64) add their geometry untyped. Skipped with a warning that names
    them: tensors of a quantized type the tool does not understand (Q2_K, IQ2_XXS, ...: never guessed at),
    and matrices whose K is not a whole number of blocks (32 weights, 256 for super-block types)."""
    path = Path(path)
    reader = open_gguf(path)

    found: dict[str, dict[tuple[int, int], set[str]]] = {}
    unknown: set[str] = set()
    unsupported: dict[str, list[str]] = {}  # GGUF type -> tensor names
    bad_k = 0
    by_name = {t.name: ([int(d) for d in t.shape], t.tensor_type.name) for t in reader.tensors}
    if "output.weight" not in by_name and "token_embd.weight" in by_name:
        by_name["output.weight"] = by_name["token_embd.weight"]
    for name, (ne, gtype) in by_name.items():
        match = _GGUF_BLOCK.fullmatch(name)
        if name == "output.weight":
            role = "lm_head"
        elif match is None:
            continue  # token_embd, output_norm, rope factors, ...: not per-block projections
        elif match["base"] in _GGUF_ROLES:
            role = _GGUF_ROLES[match["base"]]
        else:
            if len(ne) >= 2:
                unknown.add(match["base"])
            continue
        if len(ne) != (3 if role.startswith("expert_") else 2):
            continue
        if gtype not in CODEBOOKS and gtype not in _FLOAT_TYPES:
            unsupported.setdefault(gtype, []).append(name)
            continue
        typed = gtype in CODEBOOKS
        k, n = ne[0], ne[1]
        if k % (get(gtype).weights if typed else BLOCK):
            bad_k += 1
            continue
        found.setdefault(role, {}).setdefault((n, k), set()).update([gtype] if typed else [])
    skipped = "; ".join(f"{gtype} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                        for gtype, names in sorted(unsupported.items()))
    if skipped:
        count = sum(map(len, unsupported.values()))
        warnings.warn(f"{path}: skipped {count} tensor(s) of a type the tool does not run: {skipped}",
                      stacklevel=2)
    if bad_k:
        warnings.warn(f"{path}: skipped {bad_k} tensor(s) whose K is not a whole number of blocks "
                      f"({BLOCK} weights, 256 for super-block types)", stacklevel=2)
    if unknown:
        warnings.warn(f"{path}: ignored weight tensors of unknown role: {', '.join(sorted(unknown))}",
                      stacklevel=2)
    if not found:
        also = f" of a type the tool runs (skipped: {skipped})" if skipped else ""
        raise InputError(f"{path}: no GEMV weight tensors (blk.N.attn_q.weight, ...){also} found")

    name_field = reader.get_field("general.name")
    arch_field = reader.get_field("general.architecture")
    name = _slug(str(name_field.contents())) if name_field is not None else ""
    name = name or _slug(path.stem) or path.stem
    family = (_slug(str(arch_field.contents())) if arch_field is not None else "") or "gguf"
    shapes = tuple(
        Shape(n, k, role if len(geoms) == 1 else f"{role}:{n}x{k}", name, family, tuple(sorted(types)))
        for role, geoms in found.items()
        for (n, k), types in geoms.items()
    )
    return Inventory(name, family, f"gguf:{path.name}", shapes)


# Tensor parallelism, as vLLM (ColumnParallelLinear / RowParallelLinear), TensorRT-LLM and llama.cpp's row split
# shard a block: a column-parallel projection keeps K and gives each rank N/tp outputs; a row-parallel one keeps N
# and gives each rank K/tp inputs (its partial sums are all-reduced afterwards). The merged projections (qkv,
# gate_up) split each of their parts, so every rank holds whole heads and matching gate/up halves.
COLUMN_PARALLEL = frozenset({"q", "k", "v", "qkv", "gate", "up", "gate_up", "lm_head", "expert_gate", "expert_up"})
ROW_PARALLEL = frozenset({"o", "down", "expert_down"})
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before it splits lm_head


def _heads(inv: Inventory) -> tuple[int, int, int] | None:
    """(attention heads, KV heads, head dim) from the inventory's config, None when it does not say."""
    config = dict(inv.config)
    if not all(key in config for key in ("num_attention_heads", "num_key_value_heads", "head_dim")):
        return None
    return config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]


def _split(n: int, tp: int, what: str) -> int:
    if n < tp:
        raise InputError(f"{what}: N={n} leaves less than one output per rank at tp={tp}")
    if n % tp:
        raise InputError(f"{what}: N={n} does not split {tp} ways")
    return n // tp


def _column_n(inv: Inventory, shape: Shape, base: str, tp: int, what: str) -> int:
    """Outputs per rank of a column-parallel projection. Attention projections split by whole heads; with
    fewer KV heads than ranks each rank holds one KV head (replicated, as vLLM does), which needs tp to be a
    multiple of the KV heads."""
    heads = _heads(inv)
    if base in ("q", "k", "v", "qkv") and heads is not None:
        q, kv, dim = heads
        if shape.n == {"q": q, "k": kv, "v": kv, "qkv": q + 2 * kv}[base] * dim:
            if q % tp:
                raise InputError(f"{what}: {q} attention heads do not split {tp} ways")
            if kv % tp and tp % kv:
                raise InputError(f"{what}: {kv} KV heads neither split {tp} ways nor replicate evenly over them")
            kv_rank = max(1, kv // tp)
            return {"q": q // tp, "k": kv_rank, "v": kv_rank, "qkv": q // tp + 2 * kv_rank}[base] * dim
    if base == "lm_head":
        return _split(-(-shape.n // VOCAB_PADDING) * VOCAB_PADDING, tp, what)
    if base == "gate_up":
        if shape.n % 2:
            raise InputError(f"{what}: N={shape.n} is not two equal gate and up halves")
        return 2 * _split(shape.n // 2, tp, what)
    return _split(shape.n, tp, what)


def tensor_parallel(inv: Inventory, tp: int) -> Inventory:
    """The shapes one rank of a `tp`-way tensor-parallel deployment of `inv` runs (COLUMN_PARALLEL split N,
    ROW_PARALLEL split K), named `<name>-tp<tp>`, in the same family (evaluation leaves a model's shards out
    with it). InputError naming the model, tp and role for a split that does not exist: tp < 2, a role of
    neither kind, N not divisible (attention: heads) or below one per rank, K/tp not a whole number of blocks
    (32 weights; 256 for a super-block codebook the shape is typed with)."""
    if tp < 2:
        raise InputError(f"tensor-parallel degree {tp}: must be 2 or more")
    shapes = []
    for shape in inv.shapes:
        base = shape.role.split(":")[0]
        what = f"{inv.name} tp={tp} role {shape.role}"
        if base in COLUMN_PARALLEL:
            n, k = _column_n(inv, shape, base, tp, what), shape.k
        elif base in ROW_PARALLEL:
            if shape.k % tp:
                raise InputError(f"{what}: K={shape.k} does not split {tp} ways")
            n, k = shape.n, shape.k // tp
            for unit, name in [(BLOCK, "block"), *((get(cb).weights, f"{cb} block") for cb in shape.codebooks)]:
                if k % unit:
                    raise InputError(f"{what}: K={shape.k}/{tp}={k} is not a multiple of {unit} (the {name})")
        else:
            raise InputError(f"{what}: neither column- nor row-parallel, no tensor-parallel split is known")
        role = f"{base}:{n}x{k}" if ":" in shape.role else shape.role
        shapes.append(Shape(n, k, role, f"{inv.name}-tp{tp}", inv.family, shape.codebooks))
    return Inventory(f"{inv.name}-tp{tp}", inv.family, f"{inv.source} (tensor-parallel {tp})", tuple(shapes),
                     tuple(sorted({**dict(inv.config), "tensor_parallel": tp}.items())))
