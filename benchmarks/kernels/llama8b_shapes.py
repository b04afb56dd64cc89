"""The Llama-3.1-8B layer matmuls the weight-quantization benchmarks time, declared once.

Each is (K = in features, N = out features); the weight is stored [N, K] (`[out, in]`) and a call
contracts the tokens' last axis with the weight's last (CONTRACT_IN).
"""

SHAPES = {  # name: (K = in, N = out)
    "qkv 4096x6144": (4096, 6144),  # q, k and v fused
    "qkv-q 4096x4096": (4096, 4096),  # q alone
    "kv 4096x1024": (4096, 1024),  # k or v alone
    "o 4096x4096": (4096, 4096),
    "gate/up 4096x14336": (4096, 14336),
    "down 14336x4096": (14336, 4096),
}
CONTRACT_IN = (((1,), (1,)), ((), ()))
