"""Block sizes of the Mosaic GPU ragged paged attention kernel, in one frozen, validated dataclass.

The kernel is persistent and warp specialised: `compute_wgs` compute warpgroups and one
producer warpgroup per CTA. Each compute warpgroup owns a tile of `ROWS` = 64 query rows (wgmma's
M); rows are (token, q head of the GQA group) pairs of one sequence and one kv head. A decode token
fills `group` rows of a tile; a prefill warpgroup packs `tokens_per_wg = 64 // group` tokens. K/V
stream through `num_stages` SMEM buffers of `block_kv` tokens, one bulk copy per page for K and one
for V.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

ROWS = 64  # query rows per compute warpgroup (wgmma M)
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on Hopper
SMEM_SLACK = 4 * 1024  # barriers, reduction scratch and alignment


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
    The field defaults are the plain forms; default_tuning turns decode_wgs, pingpong and
    producer_warps on where the H200 measured them faster.
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

    def __post_init__(self) -> None:
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be a multiple of 64 in [64, 256]")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages=} must be >= 2")
        if self.decode_splits < 1:
            raise ValueError(f"{self.decode_splits=} must be >= 1")
        if self.num_ctas < 1:
            raise ValueError(f"{self.num_ctas=} must be >= 1")
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

    def smem_bytes(self, head_dim: int, dtype, *, a_in_smem: bool = False) -> int:
        """Shared memory the launch asks for (K/V stages, Q/O tiles, split-decode staging, the
        swizzled Q and P operand tiles when wgmma's A operands are staged through SMEM, the
        ones tiles of mma_row_sums, the log-sum-exp staging of split prefill tiles)."""
        item = jnp.dtype(dtype).itemsize
        kv = 2 * self.num_stages * self.block_kv * head_dim * item
        q = 2 * self.compute_wgs * ROWS * head_dim * item
        split = (ROWS * head_dim * 4 + ROWS * 4) * self.decode_wgs if self.decode_splits > 1 else 0
        a_ops = self.compute_wgs * ROWS * (head_dim + self.block_kv) * item if a_in_smem else 0
        ones = self.compute_wgs * ROWS * self.block_kv * item if self.mma_row_sums else 0
        lse = self.compute_wgs * ROWS * 4 if self.prefill_kv_splits > 1 else 0
        return kv + q + split + a_ops + ones + lse

    @property
    def compute_registers(self) -> int:
        """Registers per thread of a compute warpgroup (a CTA has 64K for all its warpgroups)."""
        return 232 if self.compute_wgs == 2 else 160

    @property
    def producer_registers(self) -> int:
        return 40 if self.compute_wgs == 2 else 32

    def check_fits(
        self, head_dim: int, page_size: int, dtype, *, on_chip: bool = True, a_in_smem: bool = False
    ) -> None:
        """ValueError unless pages tile into blocks, the compute warpgroups' registers hold the
        head_dim, and (on_chip: a real GPU) SMEM suffices."""
        if page_size % self.block_kv and self.block_kv % page_size:
            raise ValueError(f"{page_size=} and {self.block_kv=}: one must divide the other")
        if self.compute_wgs == 3 and (head_dim > 64 or self.block_kv > 128):
            raise ValueError(
                f"compute_wgs=3 holds head_dim <= 64 and block_kv <= 128 in its registers, not "
                f"{head_dim=}, {self.block_kv=}"
            )
        need = self.smem_bytes(head_dim, dtype, a_in_smem=a_in_smem)
        if on_chip and need > SMEM_BYTES - SMEM_SLACK:
            raise ValueError(f"{self} needs {need} bytes of SMEM for {head_dim=}, {dtype=}")


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
) -> TuningConfig:
    """A schedule from static shapes only; the choices are backed by docs/benchmarks.md (H200).

    Decode on both compute warpgroups (decode_wgs=2) measured equal or faster at batch 256 and 512
    in every layout (up to +19%); it is taken where decode is not split, the form measured.
    head_dim 128: with decode_wgs=2, 128-token blocks x 2 stages decode at or above 64 x 3 in 7 of
    8 cases of batch 256/512 x ctx 512-8192 (the headline, B=256 ctx 1024: 81.6-84.9% of the copy
    rate in eight measurements over four calls), and prefill 8192-token chunks faster (482
    against 452 TFLOP/s). They leave no room for split-decode staging: split buckets take 64 x 3.
    head_dim 64: 128-token blocks x 3 stages, as measured for both layouts, decode and prefill.
    Ping-pong measured equal or faster on every prefill chunk of 2,048 tokens and more (+3-10%).
    Four producer warps (producer_warps=4) measured faster or equal (within 1%) decode at batch
    256/512 in 20 of 21 pairs (up to +16%, 9q/3kv/64) and faster head_dim-128 prefill (+3-6%).
    Split decode (batch 32) was not shown faster: those calls are dispatch-bound and noisy, so
    split decode buckets keep one producer thread; prefill buckets (2,048 tokens and more) take
    four warps, split or not (head_dim 128 prefill +3-6% with them, kernel run 7).
    head_dim <= 64 prefill buckets: three compute warpgroups with 128 x 2 blocks, no ping-pong
    and no decode splits (kernel run 7). Against two warpgroups, with four producer warps or
    against one: 32q/8kv/64 at 8,192 tokens +6-14%, 9q/3kv/64 at 2,048 tokens after 6,144 cached
    +8-51% (calls R-T, V, W; in call U, whose three-warpgroup form had one producer thread,
    -1% and -2%); other rows within the spread either way, except 32q/8kv/64 at 2,048 after
    6,144, 4-9% slower in three calls (fewer, bigger tiles: 344 items for 132 SMs). A token
    ring among three warpgroups, 128 x 3 stages and split-decode staging (more SMEM) measured
    slower. With mma_row_sums (kernel run 8, calls AK and AL): 32q/8kv/64 at 8,192 tokens +10%
    in both calls (448-453 against 407-409 TFLOP/s), at 2,048 after 6,144 cached +6% to +24%,
    9q/3kv/64 -4% to +17%. prefill_kv_splits=4 where the full bucket has fewer tiles than SMs
    (needs num_q_heads; kernel run 9, calls AN and AP): 9q/3kv/64 at 2,048 tokens after 6,144
    cached, kernel 0.077 against 0.103-0.104 ms (the call's device time with the merge 0.099
    against 0.112), from position 0 even; where tiles are plenty (4,096 and 8,192 tokens,
    32q/8kv/64) cutting only added the merge.
    """
    prefill_heavy = num_tokens >= 2048
    # head_dim <= 64 prefill: three compute warpgroups, 128 x 2 blocks, no ping-pong, no decode
    # splits, row sums on the tensor cores (see above; 160 KiB of SMEM for head_dim 64).
    if prefill_heavy and head_dim <= 64 and not (page_size % 128 and 128 % page_size):
        kv_splits = 1
        if num_q_heads is not None:  # fewer tiles than SMs in a full bucket: cut them in parts
            tokens_per_tile = 3 * (ROWS // max(1, num_q_heads // num_kv_heads))
            if -(-num_tokens // tokens_per_tile) * num_kv_heads < num_ctas:
                kv_splits = 4
        return TuningConfig(
            128,
            2,
            1,
            num_ctas,
            compute_wgs=3,
            decode_wgs=2,
            producer_warps=4,
            mma_row_sums=True,
            prefill_kv_splits=kv_splits,
        )
    if head_dim < 128:
        prefs = [(128, 3), (128, 2), (64, 3)]
    else:
        prefs = [(128, 2), (64, 3), (64, 2)]
    prefs = [(bk, s) for bk, s in prefs if not (page_size % bk and bk % page_size)]
    prefs = prefs or [(max(64, min(256, page_size)), 2)]
    max_blocks = max(1, pages_per_seq * page_size // prefs[-1][0])
    # Split decode items until there are about two per CTA, but never below 4 blocks per split.
    items = max(1, num_seqs * num_kv_heads)
    splits = max(1, min(-(-2 * num_ctas // items), max_blocks // 4, 16))
    # Split-decode staging costs SMEM: prefill-heavy buckets drop the splits before the big blocks,
    # decode buckets keep the splits and take smaller blocks.
    order = (
        [(p, k) for p in prefs for k in (splits, 1)]
        if prefill_heavy
        else [(p, k) for k in (splits, 1) for p in prefs]
    )
    budget = SMEM_BYTES - SMEM_SLACK
    for (bk, stages), want_splits in order:
        whole = want_splits == 1  # decode not split: both decode warpgroups
        cfg = TuningConfig(
            bk,
            stages,
            want_splits,
            num_ctas,
            decode_wgs=2 if whole else 1,
            pingpong=True,
            producer_warps=4 if whole or prefill_heavy else 1,
        )
        if cfg.smem_bytes(head_dim, dtype) <= budget:
            return cfg
    return TuningConfig(64, 2, 1, num_ctas, decode_wgs=2, pingpong=True, producer_warps=4)
