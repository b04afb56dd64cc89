"""Command-line flags for an engine, shared by every CLI command that builds one."""

from __future__ import annotations

import argparse
import dataclasses

from nori_jax.engine_config import ATTENTION_BACKENDS, EngineConfig
from nori_jax.mesh_config import MeshConfig
from nori_jax.quantization.scheme import QUANTIZATION_MODES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file, or shape preset (with --load-format dummy); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    g.add_argument(
        "--config",
        default=None,
        help="engine YAML (a path or a name in configs/engine/); flags override it",
    )
    g.add_argument("--tokenizer", default=None, help="HF directory whose tokenizer.json to use")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATION_MODES),
        help="store the linear layers' weights quantized (fp8: fp8 matmuls; int8/int4: "
        "weight-only); a GGUF file's own Q8_0/Q4_0/Q4_1 blocks are kept",
    )
    g.add_argument("--load-format", default=None, choices=["auto", "dummy", "safetensors", "gguf"])
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )
    g.add_argument(
        "--long-prefill-threshold",
        type=int,
        default=None,
        help="prompts of at least this many tokens go to the isolated long queue (0: no isolation)",
    )
    g.add_argument("--max-num-waiting", type=int, default=None, help="bound on the waiting queue")
    g.add_argument(
        "--kv-headroom",
        type=float,
        default=None,
        help="fraction of KV pages admission keeps free for running requests' growth",
    )
    g.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="do not overlap planning step N+1 with the device running step N",
    )
    g.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS))
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=None,
        dest="tp",
        help="devices on the mesh axis `model`",
    )
    g.add_argument("--seed", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "load_format": args.load_format,
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": False if args.no_prefix_caching else None,
        "long_prefill_threshold": args.long_prefill_threshold or None,
        "max_num_waiting": args.max_num_waiting,
        "attention_backend": args.attention_backend,
        "seed": args.seed,
        "kv_headroom": args.kv_headroom,
        "async_scheduling": False if args.sync_scheduling else None,
        "mesh": MeshConfig(model=args.tp) if args.tp else None,
    }
    if args.config:
        config = EngineConfig.from_yaml(args.config, **overrides)
        if args.long_prefill_threshold == 0:  # 0 turns a preset's isolation off
            config = dataclasses.replace(config, long_prefill_threshold=None)
        return config
    return EngineConfig.from_dict({k: v for k, v in overrides.items() if v is not None})
