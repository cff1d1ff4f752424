"""The engine's KV cache: keys and values of every row, indexed by position.

Row b's token at position p sits in column p of row b's cache, so each row holds just its own
tokens -- no padding columns -- and a decode step reads each row's filled part only (the
decode-attention kernel stops at the row's position). A prompt batch is right-padded for its
one prefill forward: a short row's pad tokens fill columns past its length, and the row's
decode steps overwrite them, each writing its column before reading up to it.

The cache is preallocated, max_batch_size rows of max_seq_len columns per layer (a slot per
row, not pages: rows of very different lengths leave the unused end of their slots empty but
never read it).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, n_layers: int, max_batch_size: int, n_kv_heads: int, max_seq_len: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        """Per layer, (max_batch_size, KV, max_seq_len, D): keys after q/k norm and RoPE."""
        self.v = [torch.zeros_like(k) for k in self.k]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def write_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, KV, T, D) of a right-padded prompt batch into rows 0..B-1, columns 0..T-1."""
        B, _, T, _ = k.shape
        self.k[layer][:B, :, :T] = k
        self.v[layer][:B, :, :T] = v

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across the layers (keys and values)."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()
