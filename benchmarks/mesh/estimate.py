"""Predicted costs of spreading one model over GPUs, before any multi-GPU run (docs/mesh.md,
"Predicted costs"): the tensor-parallel all-reduces of a step and the KV transfer of a
disaggregated request, for a model shape (default Llama-3.1-8B) on NVLink and on PCIe.

Pure arithmetic, no JAX: the inputs are the single-H200 ceilings and kernel rates measured in
docs/benchmarks.md, and the link figures below (assumptions, stated as
such). Nothing here was run on more than one GPU; the tables are a prediction for those runs to
confirm or refute.

    python benchmarks/mesh/estimate.py                     # the tables of docs/mesh.md
    python benchmarks/mesh/estimate.py --context 4096 --link-efficiency 0.7
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nori_jax.model_config import ModelConfig, load_preset  # noqa: E402 (JAX-free)

# Measured on one H200 (docs/benchmarks.md, "Ceilings" and the kernel tables).
MATMUL_TFLOPS = 813.0  # bf16 matmul 8192^3 through JAX
HBM_TBPS = 3.32  # elementwise x*2 over 2 GiB, read + write
ATTN_DECODE_TBPS = 3.65  # our decode kernel, 32q/8kv/128, 256 x 1,024 (KV bytes read)
ATTN_FLOOR_MS = 0.085  # a decode call at batch 1-32, short contexts: dispatch-bound
ATTN_PREFILL_8K_MS = 0.856  # our prefill kernel, 8,192-token chunk from 0, 32q/8kv/128
# The benchmark workload's prompt lengths (docs/benchmarks.md, Conventions): lognormal(mu 6.2,
# sigma 0.8), clipped to 6,144.
PROMPT_MU, PROMPT_SIGMA = 6.2, 0.8


@dataclasses.dataclass(frozen=True)
class Link:
    """A GPU-to-GPU path: `per_direction_gbs` of peak bandwidth each way, an achieved fraction
    of it, and the fixed cost of one collective call (launch and synchronisation)."""

    name: str
    per_direction_gbs: float
    efficiency: float
    latency_us: float

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.per_direction_gbs * 1e9 * self.efficiency


def links(args) -> list[Link]:
    # H200 SXM: 18 NVLink 4 links of 50 GB/s (25 each way) = 900 GB/s both ways, 450 each way,
    # through NVSwitch to every GPU of the host. PCIe Gen5 x16: 64 GB/s each way (~63 usable).
    return [
        Link("NVLink", 450.0, args.link_efficiency, args.nvlink_latency_us),
        Link("PCIe 5", 64.0, args.link_efficiency, args.pcie_latency_us),
    ]


def decoder_params(cfg: ModelConfig) -> int:
    """Weights every token of a step multiplies through: the decoder's linear layers."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2  # q, o; k, v
    return cfg.num_layers * (attn + 3 * h * f)


def linear_params(cfg: ModelConfig) -> int:
    """The decoder's linear layers and the LM head (which runs on one row per sequence)."""
    return decoder_params(cfg) + cfg.hidden_size * cfg.vocab_size


def kv_bytes_per_token(cfg: ModelConfig, kv_itemsize: int) -> int:
    """K and V of every layer for one token (the pages' bytes, kv_cache.bytes_per_page)."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: each device sends and receives 2 (n - 1) / n of the buffer."""
    return link.latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / link.achieved_bytes_per_s


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    return link.latency_us * 1e-6 + (n - 1) / n * nbytes / link.achieved_bytes_per_s


def compute_s(cfg: ModelConfig, tokens: int, seqs: int, context: int, n: int, prefill: bool):
    """Device time of one step on each of n devices, from the single-GPU ceilings: the linear
    layers (weight reads or FLOPs, whichever is longer) and the attention kernel (its measured
    KV rate, or its per-call floor), both split n ways."""
    weights = linear_params(cfg) * 2 / n  # bf16 bytes per device
    flops = 2 * (decoder_params(cfg) * tokens + cfg.hidden_size * cfg.vocab_size * seqs) / n
    linear = max(weights / (HBM_TBPS * 1e12), flops / (MATMUL_TFLOPS * 1e12))
    if prefill:  # scaled from the measured 8,192-token chunk (quadratic in the chunk)
        per_layer = ATTN_PREFILL_8K_MS * 1e-3 * (tokens / 8192) ** 2 / n
    else:
        kv = seqs * context * kv_bytes_per_token(cfg, 2) / cfg.num_layers / n
        per_layer = max(ATTN_FLOOR_MS * 1e-3, kv / (ATTN_DECODE_TBPS * 1e12))
    return linear + cfg.num_layers * per_layer


def tp_rows(cfg: ModelConfig, args) -> list[list[str]]:
    rows = []
    cases = [(f"decode {b} x {args.context}", b, b, False) for b in args.batches]
    cases.append((f"prefill chunk {args.prefill_tokens}", args.prefill_tokens, 1, True))
    for label, tokens, seqs, prefill in cases:
        ar_bytes = tokens * cfg.hidden_size * 2  # bf16 [T, H]
        calls = 2 * cfg.num_layers + 1  # o_proj and down_proj per layer, the embedding lookup
        logits = seqs * cfg.vocab_size * 4  # float32 [S, V], gathered for the sampler
        base = compute_s(cfg, tokens, seqs, args.context, 1, prefill)
        for n in args.tp:
            comp = compute_s(cfg, tokens, seqs, args.context, n, prefill)
            row = [label, str(n), _bytes(ar_bytes), f"{base * 1e3:.2f}", f"{comp * 1e3:.2f}"]
            for link in links(args):
                comm = calls * all_reduce_s(ar_bytes, n, link) + all_gather_s(logits, n, link)
                row += [f"{comm * 1e3:.2f}", f"{100 * comm / (comp + comm):.0f}%"]
            rows.append(row)
    return rows


def kv_rows(cfg: ModelConfig, args) -> list[list[str]]:
    per_token = kv_bytes_per_token(cfg, args.kv_itemsize)
    lengths = [
        ("median", math.exp(PROMPT_MU)),
        ("mean", math.exp(PROMPT_MU + PROMPT_SIGMA**2 / 2)),
        ("P99", math.exp(PROMPT_MU + 2.326 * PROMPT_SIGMA)),
        ("clip", 6144),
    ]
    rows = []
    for name, tokens in lengths:
        tokens = round(tokens)
        nbytes = tokens * per_token
        prefill = compute_s(cfg, tokens, 1, tokens, 1, prefill=True)
        row = [f"{name} {tokens}", _bytes(nbytes), f"{prefill * 1e3:.1f}"]
        for link in links(args):
            t = link.latency_us * 1e-6 + nbytes / link.achieved_bytes_per_s
            row.append(f"{t * 1e3:.2f} ({100 * t / prefill:.0f}%)")
        rows.append(row)
    return rows


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.1-8b", help="shape preset in configs/models/")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 1024])
    p.add_argument("--context", type=int, default=1024, help="tokens cached per decode row")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--link-efficiency", type=float, default=0.8, help="achieved / peak")
    p.add_argument("--nvlink-latency-us", type=float, default=10.0, help="per collective call")
    p.add_argument("--pcie-latency-us", type=float, default=20.0, help="per collective call")
    p.add_argument("--kv-itemsize", type=int, default=2, help="bytes per KV value (1: fp8)")
    args = p.parse_args(argv)
    cfg = ModelConfig.from_hf_dict(load_preset(args.model))
    print(
        f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}q/{cfg.num_kv_heads}kv/{cfg.head_dim}, {linear_params(cfg) / 1e9:.2f}B "
        f"linear weights; links at {args.link_efficiency:.0%} of peak "
        f"(NVLink 450 GB/s, PCIe 64 GB/s each way), {args.nvlink_latency_us:g} / "
        f"{args.pcie_latency_us:g} us per collective call\n"
    )
    print("Tensor parallelism, per step (ms on each device; comms: 2 all-reduces per layer + 1,")
    print("and the float32 logits all-gather; share = comms / (compute + comms), no overlap)\n")
    header = ["step", "tp", "bytes / all-reduce", "compute tp1", "compute tpN"]
    header += ["NVLink comms", "share", "PCIe comms", "share"]
    print(table(header, tp_rows(cfg, args)))
    print(
        f"\nKV transfer per request, prefill replica to decode replica "
        f"({kv_bytes_per_token(cfg, args.kv_itemsize) / 1024:.0f} KiB per token; ms, and % of "
        "the request's own prefill on one GPU)\n"
    )
    header = ["prompt tokens", "KV bytes", "prefill ms (tp1)", "NVLink", "PCIe 5"]
    print(table(header, kv_rows(cfg, args)))


if __name__ == "__main__":
    main()
