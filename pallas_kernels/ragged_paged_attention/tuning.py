"""Block sizes of the Mosaic GPU ragged paged attention kernel, in one frozen, validated dataclass.

The kernel is persistent and warp specialised: `compute_wgs` compute warpgroups and one
producer warpgroup per CTA. Each compute warpgroup owns a tile of `ROWS` = 64 query rows (wgmma's
M); rows are (token, q head of the GQA group) pairs of one sequence and one kv head. A decode token
fills `group` rows of a tile; a prefill warpgroup packs `tokens_per_wg = 64 // group` tokens. K/V
stream through `num_stages` SMEM buffers of `block_kv` tokens, one bulk copy per page for K and one
for V.

`default_tuning` picks a TuningConfig per compiled bucket from a table: BLOCKS (KV block shapes
per head_dim class) and RULES (which fields a bucket gets), each row with the measurement behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

ROWS = 64  # query rows per compute warpgroup (wgmma M)
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on Hopper
SMEM_SLACK = 4 * 1024  # barriers, reduction scratch and alignment
PER_STEP = "per_step"  # TuningConfig.prefill_interleave: the schedule picks the form per call
MAX_STAGES = 16  # KV buffers; the table measured 2-7
MAX_DECODE_SPLITS = 64  # default_tuning takes at most 16
MAX_CTAS = 1024  # persistent CTAs, one per SM (an H100 or H200 has 132)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static schedule of one launch.

    block_kv:      tokens of K (and of V) per pipeline stage; a multiple of 64, at most 256.
    num_stages:    K/V stages in flight per CTA (>= 2).
    decode_splits: KV splits per (decode sequence, kv head); > 1 adds a small combine pass and is
                   what keeps the GPU busy at small batch.
    num_ctas:      persistent CTAs (use the SM count; tests use a few).
    compute_wgs:   compute warpgroups per CTA: 2 (a prefill tile is 128 rows; 232 registers
                   each) or 3 (192 rows; 160 registers each, enough for head_dim <= 64 only):
                   with three, two warpgroups' matmuls can cover one's softmax, which at
                   head_dim 64 costs as much as its matmuls.
    decode_wgs:    compute warpgroups that take decode items: 1 (warpgroup 0; the others only
                   release the K/V stages) or 2 (items alternate between warpgroups 0 and 1, so
                   one warpgroup's epilogue, output store and next Q overlap the other's
                   blocks). Each then has its own split-decode staging.
    decode_interleave: 0, or a block count k: decode items of at least k KV blocks are computed by
                   both compute warpgroups. The item's owner (Items.decode_owner) computes its
                   blocks b0, b0 + 2, ..., the other warpgroup b0 + 1, b0 + 3, ... and releases
                   the rest; the other then hands its partial softmax state (O, row max,
                   denominator) to the owner through SMEM, which merges the two and stores the
                   output. Without it a decode item is its owner's alone, and since a stage is
                   released only once both have arrived on it, the other waits for every block
                   of that item to land before its own next one (docs/benchmarks.md, "The two
                   decode warpgroups wait on each other"). The hand-over costs about as much as
                   a block, so short items keep one owner. Needs compute_wgs=2; an fp8 K is
                   converted just before its Q K^T in such items (fp8_convert_early does not
                   apply to them).
    pingpong:      prefill tiles: the two compute warpgroups take turns on the tensor cores
                   through a shared rendezvous barrier, so one's softmax overlaps the other's
                   matmuls (FlashAttention-3's ping-pong schedule, mgpu_turns.py). Decode items
                   never wait on it. Two compute warpgroups only.
    producer_warps: 1 (one thread of the producer warpgroup issues every copy) or 4 (its warps
                   share the K/V copies, mgpu_producer.py): with small pages a block is many
                   small copies, and one thread's issue rate can fall behind the tensor cores.
    mma_row_sums:  the softmax denominators on the tensor cores: each block's P times a [block_kv,
                   8] tile of ones (one small wgmma next to P V) instead of 64 adds and shuffles
                   per thread and block. The softmax's instruction stream is what bounds
                   head_dim-64 prefill, and the adds are about a fifth of it (64 of ~340
                   instructions). The sums are then of P as P V sees it (in the KV dtype), so
                   numerator and denominator round alike. Costs 64 x block_kv of ones in SMEM
                   per compute warpgroup.
    prefill_kv_splits: at most this many parts per prefill tile, each over a range of the tile's
                   KV blocks (schedule.prefill_parts decides per step: only when the step has
                   too few tiles to keep every SM busy to the end). Parts write partial outputs
                   and their log-sum-exp; partial_merge.py combines them, which reads
                   prefill_kv_splits - 1 more output-sized buffers after the kernel.
    fp8_convert_early: fp8 pages without fp8_qk (their K converted to float16): each compute
                   warpgroup converts the next block's K while the tensor cores run this block's
                   P V, instead of just before the Q K^T that reads it. (V is never converted:
                   P V multiplies an e4m3 P with the 8-bit V^T stage, mgpu_consumer.py.)
                   default_tuning turns it on for fp8 decode buckets (RULES).
    fp8_qk:        fp8 pages only: Q K^T as an fp8 x fp8 wgmma on the K stage itself (K-major, as
                   fp8 wgmma needs), Q quantized per row (absmax scale, to e4m3 on either page
                   dtype: reference.QUERY_DTYPE) into an 8-bit SMEM tile per compute warpgroup;
                   the row scales join the softmax scale. Neither K nor V is then converted.
                   Costs Q's precision: a per-row e4m3 Q (reference.quantize_query_rows).
                   default_tuning turns it on for fp8 pages in every bucket (RULES,
                   reads_fp8_query), and api.py's reference path then quantizes Q the same way.
    prefill_interleave: a prefill tile is one warpgroup's 64 rows (tokens_per_wg tokens), and
                   both compute warpgroups compute it, every other KV block each, as
                   decode_interleave does for decode items: warpgroup 1 hands its partial state
                   to warpgroup 0, which merges, normalises and stores the tile (tiles of one
                   block are warpgroup 0's alone). A short chunk has few tiles for the SMs and
                   each tile's chain of blocks is the call's critical path; this halves the
                   chain and doubles the tiles. Needs compute_wgs=2, no pingpong (the two
                   warpgroups compute different blocks, so their softmaxes do not meet) and
                   prefill_kv_splits=1.
                   "per_step": the schedule picks, for each call, between that form and tiles of
                   one box per compute warpgroup (with pingpong, if set): interleaved where
                   schedule.interleave_pays finds the CTAs' longest chain of blocks shorter with
                   it (few, long tiles: a short chunk, or a chunk from position 0, whose last
                   tiles see the most blocks), paired otherwise (tiles enough for two rounds of
                   the SMs, each of them long). The kernel reads the choice from the plan's
                   metadata. Needs compute_wgs=2 and prefill_kv_splits=1.
    The field defaults are the plain forms; default_tuning turns decode_wgs, pingpong and
    producer_warps on where the H200 measured them faster, and prefill_interleave where the
    H100 did (RULES).
    """

    block_kv: int = 128
    num_stages: int = 2
    decode_splits: int = 1
    num_ctas: int = 132
    compute_wgs: int = 2
    decode_wgs: int = 1
    pingpong: bool = False
    producer_warps: int = 1
    mma_row_sums: bool = False
    prefill_kv_splits: int = 1
    fp8_convert_early: bool = False
    fp8_qk: bool = False
    decode_interleave: int = 0
    prefill_interleave: bool | str = False  # or PER_STEP

    def __post_init__(self) -> None:
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be a multiple of 64 in [64, 256]")
        # Upper bounds too: a schedule can come from a user (attention_tuning), and interpret
        # mode, which has no SMEM to run out of, would allocate whatever count it is given.
        if not 2 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"{self.num_stages=} must be in [2, {MAX_STAGES}]")
        if not 1 <= self.decode_splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"{self.decode_splits=} must be in [1, {MAX_DECODE_SPLITS}]")
        if not 1 <= self.num_ctas <= MAX_CTAS:
            raise ValueError(f"{self.num_ctas=} must be in [1, {MAX_CTAS}]")
        # Counts are ints, not bools: True == 1 would pass the membership tests below.
        if isinstance(self.compute_wgs, bool) or self.compute_wgs not in (2, 3):
            raise ValueError(f"{self.compute_wgs=} must be 2 or 3")
        if isinstance(self.decode_wgs, bool) or self.decode_wgs not in (1, 2):
            raise ValueError(f"{self.decode_wgs=} must be 1 or 2")
        if not isinstance(self.pingpong, bool):  # it picks a kernel form: no truthy strings
            raise ValueError(f"{self.pingpong=} must be a bool")
        if self.pingpong and self.compute_wgs != 2:
            raise ValueError(f"pingpong=True needs compute_wgs=2, not {self.compute_wgs=}")
        if isinstance(self.producer_warps, bool) or self.producer_warps not in (1, 4):
            raise ValueError(f"{self.producer_warps=} must be 1 or 4")
        if not isinstance(self.mma_row_sums, bool):
            raise ValueError(f"{self.mma_row_sums=} must be a bool")
        if isinstance(self.prefill_kv_splits, bool) or self.prefill_kv_splits not in range(1, 9):
            raise ValueError(f"{self.prefill_kv_splits=} must be an int in [1, 8]")
        if not isinstance(self.fp8_convert_early, bool):
            raise ValueError(f"{self.fp8_convert_early=} must be a bool")
        if not isinstance(self.fp8_qk, bool):
            raise ValueError(f"{self.fp8_qk=} must be a bool")
        if (
            isinstance(self.decode_interleave, bool)
            or not isinstance(self.decode_interleave, int)
            or self.decode_interleave < 0
        ):
            raise ValueError(f"{self.decode_interleave=} must be an int >= 0 (a block count)")
        if self.decode_interleave and self.compute_wgs != 2:
            raise ValueError(f"decode_interleave needs compute_wgs=2, not {self.compute_wgs=}")
        pil = self.prefill_interleave
        if not (isinstance(pil, bool) or (isinstance(pil, str) and pil == PER_STEP)):
            raise ValueError(f"{self.prefill_interleave=} must be a bool or {PER_STEP!r}")
        if pil is True and (self.compute_wgs != 2 or self.pingpong or self.prefill_kv_splits != 1):
            raise ValueError(
                "prefill_interleave needs compute_wgs=2, pingpong=False and prefill_kv_splits=1, "
                f"not {self.compute_wgs=}, {self.pingpong=}, {self.prefill_kv_splits=}"
            )
        if pil == PER_STEP and (self.compute_wgs != 2 or self.prefill_kv_splits != 1):
            raise ValueError(
                f"prefill_interleave={PER_STEP!r} needs compute_wgs=2 and prefill_kv_splits=1, "
                f"not {self.compute_wgs=}, {self.prefill_kv_splits=}"
            )

    @property
    def hands_over(self) -> bool:
        """Whether one compute warpgroup hands a partial softmax state to the other (the
        interleaved forms), which takes a staging buffer and its two barrier pairs."""
        return bool(self.decode_interleave) or self.prefill_interleave is not False

    @property
    def prefill_per_step(self) -> bool:
        """Whether each call picks interleaved or paired prefill tiles (prefill_interleave)."""
        return self.prefill_interleave == PER_STEP

    @property
    def prefill_boxes(self) -> int:
        """64-row Q boxes per prefill tile: one per compute warpgroup, or one shared by both
        (prefill_interleave=True). The per-step form keeps one per compute warpgroup: a step
        of interleaved tiles copies its box into both (mgpu_producer.py)."""
        return 1 if self.prefill_interleave is True else self.compute_wgs

    def smem_bytes(self, head_dim: int, dtype, *, a_in_smem: bool = False, kv_dtype=None) -> int:
        """Shared memory the launch asks for (K/V stages in the pages' dtype `kv_dtype`, default
        `dtype`; Q/O tiles, split-decode staging, the swizzled Q and P operand tiles when wgmma's
        A operands are staged through SMEM, the ones tiles of mma_row_sums, the log-sum-exp
        staging of split prefill tiles, and with fp8 pages each compute warpgroup's 8-bit P
        tile, its dequantized K block (without fp8_qk) or its 8-bit Q tile (with it); with
        decode_interleave or prefill_interleave the f32 state one compute warpgroup hands to
        the other)."""
        item = jnp.dtype(dtype).itemsize
        kv_item = jnp.dtype(kv_dtype or dtype).itemsize
        fp8 = kv_item == 1
        mma_item = 2 if fp8 and item < 4 else item  # fp8 pages: float16 operands
        p_item = 1 if fp8 else mma_item  # fp8 pages: an e4m3 P
        kv = 2 * self.num_stages * self.block_kv * head_dim * kv_item
        q = 2 * self.compute_wgs * ROWS * head_dim * item
        split = (ROWS * head_dim * 4 + ROWS * 4) * self.decode_wgs if self.decode_splits > 1 else 0
        qa = self.compute_wgs * ROWS * head_dim * mma_item if a_in_smem else 0
        pa = self.compute_wgs * ROWS * self.block_kv * p_item if a_in_smem or fp8 else 0
        ones = self.compute_wgs * ROWS * self.block_kv * p_item if self.mma_row_sums else 0
        lse = self.compute_wgs * ROWS * 4 if self.prefill_kv_splits > 1 else 0
        dq = (
            self.compute_wgs * self.block_kv * head_dim * mma_item if fp8 and not self.fp8_qk else 0
        )
        q8 = self.compute_wgs * ROWS * head_dim * kv_item if fp8 and self.fp8_qk else 0
        mix = ROWS * head_dim * 4 + 2 * ROWS * 4 if self.hands_over else 0
        return kv + q + split + qa + pa + ones + lse + dq + q8 + mix

    @property
    def compute_registers(self) -> int:
        """Registers per thread of a compute warpgroup (a CTA has 64K for all its warpgroups)."""
        return 232 if self.compute_wgs == 2 else 160

    @property
    def producer_registers(self) -> int:
        return 40 if self.compute_wgs == 2 else 32

    def check_fits(
        self,
        head_dim: int,
        page_size: int,
        dtype,
        *,
        on_chip: bool = True,
        a_in_smem: bool = False,
        kv_dtype=None,
    ) -> None:
        """ValueError unless pages tile into blocks, the compute warpgroups' registers hold the
        head_dim, and (on_chip: a real GPU) SMEM suffices."""
        if page_size % self.block_kv and self.block_kv % page_size:
            raise ValueError(f"{page_size=} and {self.block_kv=}: one must divide the other")
        if kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1 and self.block_kv > 128:
            # a chunk of a V^T stage (Statics.v_chunk) is one swizzled tile wide: 128 bytes
            raise ValueError(f"{self.block_kv=} must be <= 128 with fp8 pages")
        if self.compute_wgs == 3 and (head_dim > 64 or self.block_kv > 128):
            raise ValueError(
                f"compute_wgs=3 holds head_dim <= 64 and block_kv <= 128 in its registers, not "
                f"{head_dim=}, {self.block_kv=}"
            )
        need = self.smem_bytes(head_dim, dtype, a_in_smem=a_in_smem, kv_dtype=kv_dtype)
        if on_chip and need > SMEM_BYTES - SMEM_SLACK:
            raise ValueError(f"{self} needs {need} bytes of SMEM for {head_dim=}, {dtype=}")


PREFILL_BUCKET_TOKENS = 2048


def reads_fp8_query(kv_dtype) -> bool:
    """Whether a call's default schedule reads Q rows in fp8 (fp8_qk; RULES): fp8 pages, in
    every bucket, Q in e4m3 (reference.QUERY_DTYPE) on e5m2 pages too, whose K wgmma multiplies
    with an e4m3 Q (Hopper takes the mixed pair; a Q in e5m2's two mantissa bits cost the
    embedded model 6% perplexity, docs/benchmarks.md, "FP8 KV pages"). api.py's reference path
    quantizes Q where this holds, so the engine has the GPU kernel's numerics on every backend,
    and a chunk's tokens do not depend on the size of the step it was batched into."""
    return kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static shapes of one compiled call, all that default_tuning sees."""

    num_seqs: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    num_tokens: int
    num_q_heads: int | None
    num_ctas: int
    kv_fp8: bool = False  # 8-bit pages, converted to float16 in the kernel
    fp8_query: bool = False  # reads_fp8_query: Q K^T in fp8 (fp8 pages)

    @property
    def prefill(self) -> bool:  # a token bucket of 2,048 and more: prefill chunks dominate
        return self.num_tokens >= PREFILL_BUCKET_TOKENS

    @property
    def fp8_decode(self) -> bool:  # fp8 pages in a decode bucket: blocks and rules of their own
        return self.kv_fp8 and not self.prefill

    def tiles_pages(self, block_kv: int) -> bool:
        return not (self.page_size % block_kv and block_kv % self.page_size)


def _few_tiles(b: Bucket) -> bool:
    """A full bucket of three-warpgroup tiles has fewer (tile, kv head) items than SMs."""
    if b.num_q_heads is None:
        return False
    tokens_per_tile = 3 * (ROWS // max(1, b.num_q_heads // b.num_kv_heads))
    return -(-b.num_tokens // tokens_per_tile) * b.num_kv_heads < b.num_ctas


def _one_round_of_boxes(b: Bucket) -> bool:
    """A full bucket of one-box prefill tiles (prefill_interleave) has no more (tile, kv head)
    items than SMs: interleaving doubles the items, and where that needs a second round the
    longest CTA's chain of blocks grows instead of halving."""
    if b.num_q_heads is None:
        return False
    tokens_per_box = ROWS // max(1, b.num_q_heads // b.num_kv_heads)
    return -(-b.num_tokens // tokens_per_box) * b.num_kv_heads <= b.num_ctas


# The tuning table. Evidence: docs/benchmarks.md, "Attention kernels", kernel run N (H200, page
# 16, 32q/8kv/128 unless a row says otherwise); percentages are of the measured copy or matmul rate.

# KV blocks per head_dim class, preferred first: (block_kv, num_stages, evidence). A block that
# does not tile the page is skipped; the first that fits SMEM with the rules below is taken.
# fmt: off
BLOCKS: dict[str, tuple[tuple[int, int, str], ...]] = {
    "head_dim 128": (
        (128, 2, "run 5 calls G-I: decode at or above 64 x 3 in 7 of 8 cases of batch 256/512 x "
                 "ctx 512-8192, B=256 x ctx 1024 at 81.6-84.9% of copy in 8 measurements; "
                 "prefill at 8,192 tokens 482 against 452 TFLOP/s"),
        (64, 3, "run 1: the best decode block before decode_wgs=2; leaves SMEM for split-decode "
                "staging, which 128 x 2 does not"),
        (64, 2, "the smallest: fits every split-decode staging"),
    ),
    "head_dim <= 64": (
        (128, 3, "run 5 call E: prefill at 8,192 tokens (32q/8kv/64, 9q/3kv/64), 128- and "
                 "256-token blocks within the spread of each other, 64-token blocks slowest"),
        (128, 2, "next in SMEM"),
        (64, 3, "next in SMEM"),
    ),
    # fp8 pages in a decode bucket: measured on the forms that converted V (and K) to float16,
    # whose dequantized tiles took the SMEM that bf16 stages would and which deeper pipelines
    # paid (latency and the conversion bound them, not bandwidth). With V read as it lands these
    # rows are to be measured again (blocks of bf16's shape may do as well).
    "fp8 decode, head_dim 128": (
        (64, 6, "run 12 call N1: 32q/8kv/128, B=1024 x ctx 1024, 64-token pages, with fp8_qk 0.809 "
                "ms against 0.846 for 64 x 5 (bf16 pages 1.060)"),
        (64, 5, "run 11 call R5: 32q/8kv/128, B=1024 x ctx 1024, 64-token pages, 1.055 ms (bf16 "
                "pages 1.062) against 1.082 for 64 x 4 and 1.095 for 64 x 3"),
        (64, 4, "run 11 call R2: the same at 16-token pages, 1.076 ms against 1.210 for 128 x 2 "
                "(bf16's block) and 1.309 for 64 x 3 without early conversion"),
        (64, 3, "next in SMEM"),
        (64, 2, "the smallest"),
    ),
    "fp8 decode, head_dim <= 64": (
        (128, 6, "run 11 call R2: 9q/3kv/64 B=1024 x ctx 1024 0.276 ms, 32q/8kv/64 B=512 x ctx "
                 "2048 0.654 ms, against 0.284 / 0.688 with 4 stages, 0.301 / 0.719 with 3, "
                 "0.321 / 0.806 for 64 x 6 and 0.332 / 0.826 for bf16's 128 x 3 converted late; "
                 "call R5 (64-token pages): 0.269 ms, as 128 x 7, against 0.278 with 4 stages"),
        (128, 4, "next in SMEM"),
        (128, 3, "next in SMEM"),
        (64, 3, "next in SMEM"),
    ),
}
# fmt: on


@dataclasses.dataclass(frozen=True)
class Rule:
    """A row of RULES: where `test(bucket, decode_splits)` holds, set `fields` (later rows win).
    `measured` is a bucket of the evidence, where the row must take effect (a test checks it)."""

    when: str
    test: Callable[[Bucket, int], bool]
    fields: dict
    evidence: str
    measured: dict


def _h200(**shape) -> dict:
    return {"num_ctas": 132, "page_size": 16, "num_q_heads": None, **shape}


def _hd64_prefill(b: Bucket, splits: int) -> bool:
    return b.prefill and b.head_dim <= 64 and b.tiles_pages(128)


_THREE_WGS = dict(block_kv=128, num_stages=2, decode_splits=1, compute_wgs=3, decode_wgs=2,
                  pingpong=False, producer_warps=4)  # fmt: skip
_HEADLINE = _h200(num_seqs=256, num_kv_heads=8, head_dim=128, pages_per_seq=64, num_tokens=256)
_PREFILL_128 = _h200(num_seqs=8, num_kv_heads=8, head_dim=128, pages_per_seq=512, num_tokens=8192)
_PREFILL_64 = {**_PREFILL_128, "head_dim": 64, "num_q_heads": 32}
_SHORT_CHUNK_64 = _h200(num_seqs=256, num_kv_heads=3, head_dim=64, pages_per_seq=128,
                        num_tokens=512, num_q_heads=9, page_size=64)  # fmt: skip
_FP8_DECODE_64 = _h200(num_seqs=1024, num_kv_heads=3, head_dim=64, pages_per_seq=64,
                       num_tokens=1024, num_q_heads=9, kv_dtype="float8_e4m3fn")  # fmt: skip

# fmt: off
RULES: tuple[Rule, ...] = (
    Rule("every bucket", lambda b, k: True, dict(pingpong=True),
         "run 5 call F: prefill ping-pong equal or faster on every chunk of 2,048 tokens and "
         "more (+3-10%); decode items never take turns", _PREFILL_128),
    Rule("decode not split", lambda b, k: k == 1, dict(decode_wgs=2, producer_warps=4),
         "run 5 call F: decode on both warpgroups equal or faster at batch 256/512 in every "
         "layout (up to +19%, 9q/3kv/64); run 6 calls M, N, P: four producer warps faster or "
         "equal (within 1%) in 20 of 21 pairs (up to +16%, 9q/3kv/64)", _HEADLINE),
    Rule("split decode", lambda b, k: k > 1, dict(decode_wgs=1, producer_warps=1),
         "run 5 call F: two warpgroups' split staging does not fit beside 64 x 3 blocks; run 6: "
         "four producer warps not shown faster at batch 32 (dispatch-bound, noisy)",
         {**_HEADLINE, "num_seqs": 32, "pages_per_seq": 512, "num_tokens": 32}),
    Rule("prefill bucket", lambda b, k: b.prefill, dict(producer_warps=4),
         "run 7: head_dim-128 prefill +3-6% with four producer warps, split decode or not",
         _PREFILL_128),
    Rule("head_dim <= 64 prefill bucket", _hd64_prefill, _THREE_WGS,
         "run 7 calls R-T, V, W: three compute warpgroups, 32q/8kv/64 at 8,192 tokens +6-14%, "
         "9q/3kv/64 at 2,048 after 6,144 cached +8-51%; 32q/8kv/64 at 2,048 after 6,144 4-9% "
         "slower (344 items for 132 SMs); a token ring, 128 x 3 and split staging slower",
         _PREFILL_64),
    Rule("head_dim <= 64 prefill bucket", _hd64_prefill, dict(mma_row_sums=True),
         "run 8 calls AK, AL: 32q/8kv/64 at 8,192 tokens +10% (448-453 against 407-409 "
         "TFLOP/s), at 2,048 after 6,144 cached +6-24%; 9q/3kv/64 -4% to +17%", _PREFILL_64),
    Rule("... whose full bucket has fewer tiles than SMs",
         lambda b, k: _hd64_prefill(b, k) and _few_tiles(b), dict(prefill_kv_splits=4),
         "run 9 calls AN, AP: 9q/3kv/64 at 2,048 tokens after 6,144 cached, kernel 0.077 "
         "against 0.103-0.104 ms; where tiles are plenty (32q/8kv/64 at 4,096 and 8,192 "
         "tokens) the merge only added time; kernel evidence only, the merge of every layer "
         "not weighed in an engine (open_targets.sh splitengine, not run yet)",
         {**_PREFILL_64, "num_kv_heads": 3, "num_q_heads": 9, "num_tokens": 2048}),
    Rule("head_dim <= 64, bf16 pages, under 2,048 tokens: prefill tiles on both warpgroups",
         lambda b, k: not b.prefill and b.head_dim <= 64 and not b.kv_fp8 and k == 1
         and _one_round_of_boxes(b),
         dict(prefill_interleave=True, pingpong=False),
         "forty-first session, H100 calls 5-7 (64-token pages, bf16, the bucket's 128 x 3 "
         "blocks): 9q/3kv/64 at 512 tokens kernel 7.7-7.9 against 10.0-10.1 us (cuDNN 7.5-7.6), "
         "512 after 7,680 cached 47.7-47.9 against 78.2; where one-box tiles need a second round "
         "(_one_round_of_boxes) the chain grows instead: 9q/3kv/64 at 1,024 after 7,168 "
         "83.7-84.7 against 78.5-78.7 (from 0: 10.5-10.7 against 14.6-14.8), 32q/8kv/64 at "
         "1,024 22.2-22.4 against 17.5-17.7, at 512 even (9.9-10.1); not measured on fp8 pages",
         _SHORT_CHUNK_64),
    Rule("fp8 pages, decode bucket", lambda b, k: b.fp8_decode,
         dict(fp8_convert_early=True),
         "run 11 calls R1, R2: decode at B=1024 x ctx 1024 with bf16's blocks, 9q/3kv/64 0.299-"
         "0.301 ms against 0.330-0.332, 32q/8kv/128 (64 x 2) 1.146 against 1.210, 32q/8kv/64 "
         "(B=512 x ctx 2048) 0.719-0.725 against 0.822-0.826; B=256 9q/3kv/64 within noise",
         _FP8_DECODE_64),
    Rule("fp8 pages: Q K^T in fp8", lambda b, k: b.fp8_query,
         dict(fp8_qk=True),
         "run 12 call N1 (64-token pages, against the same schedule converting K): B=1024 x ctx "
         "1024 9q/3kv/64 0.240 against 0.270 ms (bf16 pages 0.260), 32q/8kv/128 0.846 against "
         "1.076 (bf16 1.060), B=256 x ctx 2048 9q/3kv/64 0.149 against 0.173 (bf16 0.166); run "
         "13 call N1, prefill chunks (with V converted early, the next row): 32q/8kv/128 at "
         "8,192 tokens 1.205 against 1.805 ms (bf16 0.963). Costs Q's precision: an e4m3 Q "
         "little, an e5m2 Q 6% perplexity, so Q is e4m3 on e5m2 pages too (docs/benchmarks.md, "
         "\"FP8 KV pages\"). Measured when V was converted on the compute warpgroups",
         _FP8_DECODE_64),
    Rule("fp8 pages, head_dim <= 64, decode bucket: long items on both warpgroups",
         lambda b, k: b.fp8_decode and b.head_dim <= 64 and k == 1, dict(decode_interleave=12),
         "thirty-first session, H100 calls 2-3 (64-token pages, e4m3, 128 x 6 blocks): items of "
         "12 blocks and more (1,536 tokens) on both compute warpgroups, 9q/3kv/64 at 256 x 4,096 "
         "0.194 against 0.214 ms and 512 x 2,048 0.199 against 0.208, 32q/8kv/64 at 256 x 4,096 "
         "0.452 against 0.498 and 512 x 2,048 (every item) 0.427 against 0.459; at 1,024 x 1,024, "
         "where no item has 12 blocks, even (0.200 against 0.198-0.200; 0.465 against 0.469), "
         "while interleaving every item there cost 4% at 9q/3kv/64 (0.207)",
         _FP8_DECODE_64),
)
# fmt: on


def _wanted_splits(b: Bucket, block_kv: int) -> int:
    """Decode splits: about two items per CTA, never fewer than 4 blocks per split, at most 16
    (flash-decoding; batch 1 and 32 are dispatch-bound either way, run 4)."""
    max_blocks = max(1, b.pages_per_seq * b.page_size // block_kv)
    items = max(1, b.num_seqs * b.num_kv_heads)
    return max(1, min(-(-2 * b.num_ctas // items), max_blocks // 4, 16))


def _candidates(b: Bucket) -> list[tuple[int, int, int]]:
    """(block_kv, num_stages, decode_splits) in the order tried: split-decode staging costs SMEM,
    so prefill buckets give up the splits before the big blocks, decode buckets the big blocks
    before the splits."""
    table = "head_dim 128" if b.head_dim >= 128 else "head_dim <= 64"
    if b.fp8_decode:
        table = f"fp8 decode, {table}"
    blocks = [(bk, s) for bk, s, _ in BLOCKS[table] if b.tiles_pages(bk)]
    blocks = blocks or [(max(64, min(256, b.page_size)), 2)]
    splits = _wanted_splits(b, blocks[-1][0])
    if b.prefill:
        return [(bk, s, k) for bk, s in blocks for k in (splits, 1)]
    return [(bk, s, k) for k in (splits, 1) for bk, s in blocks]


def default_tuning(
    *,
    num_seqs: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    dtype,
    num_ctas: int = 132,
    num_tokens: int = 0,
    num_q_heads: int | None = None,
    kv_dtype=None,
) -> TuningConfig:
    """The schedule of a bucket from its static shapes: the first candidate KV block (BLOCKS,
    _candidates) that, with the RULES applied, fits a Hopper CTA's shared memory. kv_dtype: the
    pages' dtype when it is not `dtype` (fp8 pages: decode buckets have blocks of their own,
    prefill buckets take bf16's; e4m3 pages read Q in fp8 in both, RULES)."""
    kv_fp8 = kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1
    b = Bucket(num_seqs, num_kv_heads, head_dim, page_size, pages_per_seq, num_tokens,
               num_q_heads, num_ctas, kv_fp8, reads_fp8_query(kv_dtype))  # fmt: skip
    budget = SMEM_BYTES - SMEM_SLACK
    for block_kv, stages, splits in _candidates(b):
        fields = dict(block_kv=block_kv, num_stages=stages, decode_splits=splits)
        for rule in RULES:
            if rule.test(b, splits):
                fields.update(rule.fields)
        cfg = TuningConfig(num_ctas=num_ctas, **fields)
        if cfg.smem_bytes(head_dim, dtype, kv_dtype=kv_dtype) <= budget:
            return cfg
    return TuningConfig(64, 2, 1, num_ctas, decode_wgs=2, pingpong=True, producer_warps=4)
