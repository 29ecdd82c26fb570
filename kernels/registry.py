"""Candidate registry (docs/contract.md §3): every (family, identity S, launch parameters) a shape may use.

A candidate's `ksplit` is a requested split; for a shape it acts as the effective split
S = ceil(KB / ceil(KB / ksplit)), and its identity is S (or 1 where each partition is one block, which gives
the same bytes as no split: kernels.emulate.identity). Spellings with the same S are normalized away:
`candidates_for` keeps a candidate only where its ksplit is effective (ksplit == S), so each
(family, S, launch) appears once.

Engines: dp4a (gemv_partial) for every family, and int8 tensor cores (gemv_mma, in CTAs of 128 or 256 threads)
for wide and kpar. Both give the same bytes for the same S; the engine is a launch choice like threads or tiles.

Staged twins: at M = 1 each dp4a candidate (but two that never won) has a twin (`staged`, gemv_staged) whose CTAs
copy the activation blocks they walk into shared memory first (STAGED_BLOCK_BYTES each: direct and wide all KB,
kpar its partition), so the row rides in no register; valid where that fits beside the direct family's partials.

Row tile: a dp4a launch processes M in tiles of MT = min(next power of two >= M, the candidate's tile cap),
decoding each weight block once per tile. The cap keeps MT·CPT <= 16 accumulators per thread, which keeps
every instantiation spill-free under the 128-register cap. An mma launch takes M in tiles of 16 rows per
mma (MMA_ROWS), two of them per pass when M > 16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import Literal

from .codebooks import CODEBOOKS, get
from .emulate import effective_split, identity, partition_width
from .errors import BLOCK, InputError
from .program import MAX_REGISTERS

Family = Literal["wide", "direct", "kpar"]
Engine = Literal["dp4a", "mma"]
CODEBOOK_IDS = {name: i for i, name in enumerate(CODEBOOKS)}  # the `Codebook` enum of gemv.cu
ROW_TILES = (1, 2, 4, 8, 16)
MAX_ACCUMULATORS = 16  # MT·CPT per thread
WARP = 32
MMA_ROWS = 16  # activation rows per mma.m16n8k32 (the A operand)
MMA_OUTPUTS = 8  # outputs per mma (the B operand)
MMA_ROW_TILES = (1, 2)  # M tiles of MMA_ROWS handled per pass over the weights
SHARED_MEMORY_LIMIT = 48 * 1024  # default dynamic shared memory per CTA, no opt-in needed
STAGED_BLOCK_BYTES = 40  # one staged activation block: 32 int8 values, d_a and the integer sum (gemv.cu's)
# gemv.cu's staged walks (PIPE): PIPE_SLOTS ring slots per thread behind the staged blocks, each a batch of groups
# (pipe_slot_bytes): a group's 16-byte cells (its payload rows; Q6_K: a quad's 4 rows, their 4 high words and the
# quad's scales) and 4-byte cells (d, dmin, the sub-block scales' 3 reads, Q5_K's 8 qh words, a legacy block's high
# bits). Given only where the CTA's total fits RING_SHARED_LIMIT, the dynamic shared memory a kernel may opt in to on
# every GPU of compute capability 8.0 and above (8.6 and 8.9: 99 KB; kernels.launch opts in above
# SHARED_MEMORY_LIMIT), and where a thread walks at least RING_MIN_BLOCKS blocks: else the walk loads directly. The
# ring's copies and its shared memory (fewer CTAs per SM) cost more than they hide on shorter walks, and on every
# Q8_0 walk, whose light loop already reads near streaming speed (gemv.cu's PIPE; measured on an H100 and an H200).
PIPE_SLOTS = 2
RING_SHARED_LIMIT = 99 * 1024
RING_MIN_BLOCKS = 160
PIPE_GROUP_BYTES = {"Q4_0": 16 + 4, "Q4_1": 16 + 2 * 4, "Q5_0": 16 + 2 * 4, "Q5_1": 16 + 3 * 4, "IQ4_NL": 16 + 4,
                    "IQ4_XS": 8 * 16 + 4 * 4, "Q4_K": 8 * 16 + 5 * 4, "Q5_K": 8 * 16 + 13 * 4, "Q6_K": 9 * 16 + 4}
PIPE_BATCH = 4  # blocks a legacy walk's batch holds, each of its cpt columns; a super-block walk's: one group
REGISTER_FILE = 65536  # 32-bit registers a CTA may use (every architecture since sm_50)
# Threads per CTA a candidate may launch: what the register file holds at the compile options' register cap.
MAX_CTA_THREADS = REGISTER_FILE // MAX_REGISTERS
# gemv.cu indexes a plane's entries (weights [KB][N], activations [KB][M]) in 32 bits (block_index).
MAX_PLANE_ENTRIES = 2**32


def ticket_words(n: int) -> int:
    """u32 ticket counters at the head of a kpar workspace (gemv.cu's ticket_words): one per 8 outputs bounds the
    CTA columns of every candidate, rounded to 4 words so the partials behind them stay 16-byte aligned."""
    return ((n + 7) // 8 + 3) // 4 * 4


def shape_error(m: int, n: int, k: int) -> str | None:
    """Why no candidate runs (M, N, K), or None: M, N >= 1, K a positive multiple of BLOCK, and planes the kernels'
    32-bit indices reach (KB·max(M, N) < MAX_PLANE_ENTRIES)."""
    if m < 1 or n < 1 or k < BLOCK or k % BLOCK:
        return f"shape M={m}, N={n}, K={k} is not a GEMV shape (M, N >= 1; K a positive multiple of {BLOCK})"
    if k // BLOCK * max(m, n) >= MAX_PLANE_ENTRIES:
        return f"M={m}, N={n}, K={k}: a plane of {k // BLOCK * max(m, n)} blocks; the kernels index fewer than 2^32"
    return None


def pipe_slot_bytes(codebook: str, cpt: int) -> int:
    """A ring slot of `codebook`'s staged walk at `cpt` outputs per thread: one batch of groups (0: no ring)."""
    cb = get(codebook)
    return PIPE_GROUP_BYTES.get(cb.name, 0) * (1 if cb.superblock else PIPE_BATCH * cpt)


def row_tile(m: int, cpt: int) -> int:
    """MT for M rows: the smallest power of two >= M, capped so MT·CPT <= MAX_ACCUMULATORS."""
    cap = min(ROW_TILES[-1], MAX_ACCUMULATORS // cpt)
    return min(cap, 1 << max(0, (m - 1).bit_length()))


def mma_row_tiles(m: int) -> int:
    """M tiles of 16 rows per pass of an mma launch: two when M > 16, so M = 31 reads the weights once."""
    return MMA_ROW_TILES[-1] if m > MMA_ROWS else MMA_ROW_TILES[0]


def weights_as_a(m: int, mma_tiles: int) -> bool:
    """Whether an mma launch swaps the ring's operands (the weights of 16 outputs as A, MMA_OUTPUTS activation rows
    as B): for M <= 8, in pairs of tiles, so no C value is an empty row."""
    return m <= MMA_OUTPUTS and mma_tiles % 2 == 0


@dataclass(frozen=True)
class Candidate:
    family: Family
    ksplit: int  # requested K split; the identity for a shape is effective_split(KB, ksplit)
    threads: int  # threads along N per CTA (blockDim.x)
    cpt: int = 1  # dp4a: consecutive outputs per thread
    mma_tiles: int = 0  # tensor-core engine: 8-output mma tiles per warp; 0 selects the dp4a engine
    staged: bool = False  # dp4a at M = 1: the activation row staged per CTA in shared memory (gemv_staged)

    def __post_init__(self) -> None:
        if self.mma_tiles and (self.family == "direct" or self.cpt != 1 or self.threads % WARP):
            raise ValueError(f"an mma candidate is wide or kpar with cpt 1 and whole warps, not {self}")
        if self.staged and self.mma_tiles:
            raise ValueError(f"only a dp4a candidate has a staged twin, not {self}")

    @cached_property
    def id(self) -> str:
        tail = f"mma{self.mma_tiles}" if self.mma_tiles else f"c{self.cpt}"
        return f"{self.family}.s{self.ksplit}.t{self.threads}.{tail}{'.st' if self.staged else ''}"

    @property
    def engine(self) -> Engine:
        return "mma" if self.mma_tiles else "dp4a"

    @property
    def outputs_per_cta(self) -> int:
        return self.threads // WARP * MMA_OUTPUTS * self.mma_tiles if self.mma_tiles else self.threads * self.cpt

    def split(self, k: int) -> int:
        """The effective split S this candidate runs for K (partitions launched)."""
        return effective_split(k // BLOCK, self.ksplit)

    def identity(self, k: int) -> int:
        """The arithmetic identity of its result for K: candidates with equal identities are interchangeable."""
        return identity(k // BLOCK, self.ksplit)

    @property
    def grid_split(self) -> bool:
        return self.family == "kpar"

    @property
    def cta_threads(self) -> int:
        """Threads per CTA: direct's S partitions are its second dimension (launch_geometry), kpar's the grid's."""
        return self.threads * (1 if self.grid_split else self.ksplit)

    def shared_bytes(self, m: int, k: int, codebook: str | None = None) -> int:
        """Dynamic shared memory per CTA: the direct family's partials of partitions 1..S-1, then a staged twin's
        activation blocks (direct and wide: all KB; kpar: a partition), then for `codebook`'s walk its ring
        (PIPE_SLOTS of pipe_slot_bytes), where a thread walks RING_MIN_BLOCKS blocks or more and the whole fits
        RING_SHARED_LIMIT. The three constants are read at each call, so a tool that times another kernel source
        can size that source's ring by setting them."""
        if self.family == "kpar":
            base = STAGED_BLOCK_BYTES * self.partition_width(k) if self.staged else 0
        else:
            partials = (self.ksplit - 1) * row_tile(m, self.cpt) * self.threads * self.cpt * 4
            base = partials + (STAGED_BLOCK_BYTES * (k // BLOCK) if self.staged else 0)
        long_walk = bool(codebook) and self.staged and self.partition_width(k) >= RING_MIN_BLOCKS
        slot = pipe_slot_bytes(codebook, self.cpt) if long_walk else 0
        with_ring = -(-base // 16) * 16 + self.cta_threads * PIPE_SLOTS * slot
        return with_ring if slot and with_ring <= RING_SHARED_LIMIT else base

    def workspace_bytes(self, m: int, n: int, k: int) -> int:
        """kpar's workspace: ticket_words(N) u32 counters, zero before a launch and left zero by it, then the
        partial sums [S][M][N] fp32 (kernels.launch.new_workspace); other families need none."""
        return 4 * (ticket_words(n) + self.split(k) * m * n) if self.family == "kpar" else 0

    def invalid_reason(self, m: int, n: int, k: int) -> str | None:
        """Why this candidate cannot run (M, N, K), or None when it can."""
        if reason := shape_error(m, n, k):
            return reason
        if n % self.cpt:
            return f"N={n} is not a multiple of {self.cpt} outputs per thread"
        if self.mma_tiles and n % MMA_OUTPUTS:
            return f"N={n} is not a multiple of the {MMA_OUTPUTS} outputs of an mma tile"
        if self.split(k) != self.ksplit:
            return f"ksplit {self.ksplit} is not effective for KB={k // BLOCK} (it acts as S={self.split(k)})"
        if self.cta_threads > MAX_CTA_THREADS:
            return f"{self.threads}x{self.ksplit} threads exceed {MAX_CTA_THREADS} per CTA"
        if self.staged and m != 1:
            return f"a staged launch computes M = 1, not M={m}"
        if self.shared_bytes(m, k) > SHARED_MEMORY_LIMIT:
            return f"needs {self.shared_bytes(m, k)} bytes of shared memory (limit {SHARED_MEMORY_LIMIT})"
        return None

    def valid(self, m: int, n: int, k: int) -> bool:
        return self.invalid_reason(m, n, k) is None

    def kernel_name(self, codebook: str, m: int) -> str:
        """The template instantiation (NVRTC name expression) this candidate launches for M rows."""
        cb = CODEBOOK_IDS[get(codebook).name]
        split = "true" if self.grid_split else "false"
        if self.mma_tiles:
            swap = "true" if weights_as_a(m, self.mma_tiles) else "false"
            return f"gemv_mma<{cb}, {self.mma_tiles}, {mma_row_tiles(m)}, {split}, {self.threads}, {swap}>"
        if self.staged:
            return f"gemv_staged<{cb}, {self.cpt}, {split}>"
        return f"gemv_partial<{cb}, {self.cpt}, {row_tile(m, self.cpt)}, {split}>"

    def launch_geometry(self, m: int, n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(grid, block) of the main launch."""
        columns = -(-n // self.outputs_per_cta)
        if self.family == "kpar":
            return (columns, self.ksplit, 1), (self.threads, 1, 1)
        return (columns, 1, 1), (self.threads, self.ksplit, 1)

    def partition_width(self, k: int) -> int:
        return partition_width(k // BLOCK, self.ksplit)


def _build() -> tuple[Candidate, ...]:
    # wide: S = 1, tiles along N only; made for large N.
    wide = [Candidate("wide", 1, t, c) for t, c in ((128, 1), (256, 1), (128, 2))]
    # direct: S partitions inside the CTA; made for mid-size N, one launch. The narrow CTAs of 8 and 16 columns
    # by 16-64 partitions spread a small matrix over every SM in one launch with no workspace.
    direct = [
        Candidate("direct", s, t, 1)
        for t, splits in ((8, (16, 32, 64)), (16, (16, 32, 64)), (32, (2, 4, 8, 16)), (64, (2, 4, 8, 16)))
        for s in splits
        if t * s <= MAX_CTA_THREADS
    ]
    # kpar: S partitions across CTAs, folded by the last CTA of each column range; made for small N with long K.
    # At S = 64 direct's 8 columns by 64 partitions (one launch, no workspace) won every cell of the corpus; the
    # t128 c1 spelling stays as the identity's canonical launch (dispatch.learn.policy.canonical).
    kpar = [
        Candidate("kpar", s, t, c) for s in (2, 4, 8, 16, 32, 64) for t, c in ((128, 1), (64, 2)) if s < 64 or c == 1
    ]
    # Tensor-core twins of wide and kpar: made for M > 1, where dp4a is instruction-bound.
    # Two tiles per warp won nearly every M >= 4 cell of a wider H200 trial (1, 2, 4 tiles); four only for
    # lm_head-sized N without a split.
    mma = [Candidate("wide", 1, 128, mma_tiles=t) for t in (2, 4)] + [
        Candidate("kpar", s, 128, mma_tiles=2) for s in (2, 4, 8, 16, 32)
    ]
    # Rings of 8 warps of 2 tiles: a chunk's activation rows are staged once for 8 warps instead of 4, half the
    # staging per output on half the CTAs. They win few cells of an H200 corpus, by a little, and cost the sweep
    # little.
    mma += [Candidate("wide", 1, 256, mma_tiles=2)] + [Candidate("kpar", s, 256, mma_tiles=2) for s in (4, 8)]
    # 8 warps of 1 tile: the 4-warp CTA's 64 outputs with twice its warps, so at M = 16 on mid-size N,
    # where the grid fills under half a wave, each SM holds twice the warps with half the work each.
    mma += [Candidate("wide", 1, 256, mma_tiles=1)] + [Candidate("kpar", s, 256, mma_tiles=1) for s in (4, 8)]
    # Staged twins of the dp4a launches, for M = 1: fewer registers beside the weights, so more CTAs per SM (faster on
    # the large shapes, slower on small ones). Two twins won no M = 1 cell of an H200 corpus: kpar.s64.t128.c1's was
    # never within 2 % of the best, direct.s2.t32.c1's never the best; they are not built.
    never_won = {"kpar.s64.t128.c1", "direct.s2.t32.c1"}
    staged = [replace(c, staged=True) for c in wide + direct + kpar if c.id not in never_won]
    return tuple(wide + direct + kpar + mma + staged)


CANDIDATES: tuple[Candidate, ...] = _build()
BY_ID: dict[str, Candidate] = {c.id: c for c in CANDIDATES}


def by_id(candidate_id: str) -> Candidate:
    try:
        return BY_ID[candidate_id]
    except KeyError:
        raise InputError(f"unknown candidate {candidate_id!r}; known: {', '.join(BY_ID)}") from None


def candidates_for(m: int, n: int, k: int) -> list[Candidate]:
    """Candidates valid for (M, N, K), each identity spelled once (ksplit == effective S)."""
    return [c for c in CANDIDATES if c.valid(m, n, k)]


@cache
def kernel_names(codebook: str) -> tuple[str, ...]:
    """Every template instantiation a candidate may launch for this codebook: what its module compiles."""
    every_tiling = range(1, 2 * MMA_ROWS + 1)  # M values that reach every row tile of both engines
    return tuple(sorted({cand.kernel_name(codebook, m) for cand in CANDIDATES for m in every_tiling}))


def instantiations() -> list[tuple[str, str]]:
    """Every (codebook, kernel name) any candidate may launch: the set the compile check covers."""
    return [(cb, name) for cb in CODEBOOKS for name in kernel_names(cb)]
