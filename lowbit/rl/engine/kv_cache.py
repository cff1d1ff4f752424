"""The engine's KV cache: keys and values of every row, indexed by position.

Row b's token at position p sits in column p of row b's cache, so each row holds just its own
tokens -- no padding columns -- and a decode step reads each row's filled part only (the
decode-attention kernel stops at the row's position). A prompt batch is right-padded for its
one prefill forward: a short row's pad tokens fill columns past its length, and the row's
decode steps overwrite them, each writing its column before reading up to it.

GRPO samples each prompt several times: the prompt is prefilled once, into the first row that
samples it, and the other rows read its columns from that row (`share_prompts`: each row's
prefix row and length, which the decode attention takes): the rows of a group read the same
memory for the prompt in the same step, not one copy each. Each row writes only its own row, past
its prompt, so no row writes into a prefix another reads.

The cache is a slot per row, not pages: max_batch_size rows of `capacity` columns per layer
(rows of very different lengths leave the unused end of their slots empty but never read
it). The capacity grows to what a generate needs (`reserve`), up to max_seq_len, in steps that
at least double it, so a model with a 40k-token context does not hold 40k columns for 300-token
rollouts; growing reallocates (the old contents are not kept: a generate's prefill writes
what it reads), and whoever captured the old tensors in a CUDA graph captures again.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    GROWTH = 256
    """Capacity is a multiple of this many columns (or max_seq_len)."""

    def __init__(self, n_layers: int, max_batch_size: int, n_kv_heads: int, max_seq_len: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype,
                 capacity: int | None = None, routed_k: int = 0) -> None:
        """capacity: columns allocated now (default max_seq_len); routed_k: an MoE model's
        experts per token, for the routing record (`routed`)."""
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.k: list[torch.Tensor] = []
        """Per layer, (max_batch_size, KV, capacity, D): keys after q/k norm and RoPE."""
        self.v: list[torch.Tensor] = []
        self.routed_k = routed_k
        self.routed: torch.Tensor | None = None
        """MoE only: (layers, max_batch_size, capacity, k) int64, the experts each row's token
        at each position was routed to (-1: none recorded)."""
        rows = torch.arange(max_batch_size, device=device)
        self.prefix_rows = rows.clone()
        """(max_batch_size,) int64: the row that holds each row's prompt (itself unless shared)."""
        self.prefix_lens = torch.zeros_like(rows)
        """(max_batch_size,) int64: how many leading columns each row reads from prefix_rows."""
        self._allocate(min(capacity or max_seq_len, max_seq_len))

    @property
    def capacity(self) -> int:
        """Columns each row holds now."""
        return self.k[0].shape[2]

    def _allocate(self, columns: int) -> None:
        shape = (self.max_batch_size, self.n_kv_heads, columns, self.head_dim)
        self.k = self.v = []    # the old tensors go before the new ones are made
        self.routed = None
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype)
                  for _ in range(self.n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        if self.routed_k:
            self.routed = torch.full((self.n_layers, self.max_batch_size, columns, self.routed_k),
                                     -1, dtype=torch.int64, device=self.device)

    def reserve(self, columns: int) -> bool:
        """Hold at least `columns` positions a row (at most max_seq_len, the caller's check):
        True if the cache was reallocated (its contents and tensors are new)."""
        if columns <= self.capacity:
            return False
        grown = max(columns, 2 * self.capacity)
        self._allocate(min(self.max_seq_len, -(-grown // self.GROWTH) * self.GROWTH))
        return True

    def write_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, KV, T, D) of a right-padded prompt batch into rows 0..B-1, columns 0..T-1."""
        B, _, T, _ = k.shape
        self.k[layer][:B, :, :T] = k
        self.v[layer][:B, :, :T] = v

    def unshare(self) -> None:
        """Every row reads its own prompt (no shared prefixes): a generate's starting point."""
        self.prefix_rows.copy_(torch.arange(self.max_batch_size, device=self.device))
        self.prefix_lens.zero_()

    def share_prompts(self, slots: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor,
                      columns: int) -> None:
        """Prompts prefilled once each into rows 0..U-1 serve rows 0..B-1: the prompt in row
        i moves to row first[i] (the first row that samples it; first (U,) on the device), and
        row b reads its first lengths[b] columns from row first[slots[b]] (slots, lengths (B,)
        on the device). U rows are copied, not B. The routing record, read back per row, is
        copied whole to every row."""
        for layer in range(self.n_layers):
            for t in (self.k[layer], self.v[layer]):
                t[first, :, :columns] = t[:first.shape[0], :, :columns].clone()   # read, then write
        B = slots.shape[0]
        self.unshare()
        self.prefix_rows[:B] = first[slots]
        self.prefix_lens[:B] = lengths
        if self.routed is not None:
            self.routed[:, :B, :columns] = self.routed[:, slots, :columns]

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across the layers (keys and values)."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()
