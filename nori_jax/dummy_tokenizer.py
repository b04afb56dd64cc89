"""A tokenizer for shape presets, which ship no vocabulary: one token per UTF-8 byte.

Ids 0-255 are the bytes (byte-level BPE with no merges, so any text encodes and decodes exactly);
every higher id decodes to a visible placeholder `<tN>`. Benchmarks on dummy weights can then send
text or token ids alike, and streamed output is still readable.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from nori_jax.tokenizer import Tokenizer


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    if vocab_size < 258:
        raise ValueError(
            f"vocab_size={vocab_size} must be >= 258 for the byte-level dummy tokenizer"
        )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for i in range(256, vocab_size):
        vocab[f"<t{i}>"] = i
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # The last two ids act as BOS/EOS so stop handling has something to work with.
    bos, eos = vocab_size - 2, vocab_size - 1
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=(eos,),
        bos_token=f"<t{bos}>",
        eos_token=f"<t{eos}>",
    )


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256+."""
    code = ord(ch)
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
