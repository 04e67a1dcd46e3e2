"""Moving a request's KV blocks between two instances' paged caches.

Token ``i`` of a request sits at offset ``i % block_size`` of its ``i // block_size``-th
block on both sides, so a transfer copies whole blocks, layer by layer, from the source's
block table to the destination's (the tail of the last block is copied too and never read).

``LocalKVMover`` copies between two executors in one process (the offline cluster and the
tests); the cluster frees the source blocks only after the copy has landed.
"""

from __future__ import annotations

import torch


class LocalKVMover:
    """Both instances' executors in this process: one indexed copy per layer and cache."""

    def move(self, src, dst, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...],
             num_tokens: int) -> None:
        n = -(-num_tokens // src.block_size)
        if src.block_size != dst.block_size or len(src_blocks) < n or len(dst_blocks) < n:
            raise ValueError(f"cannot move {num_tokens} tokens: {len(src_blocks)} source and"
                             f" {len(dst_blocks)} destination blocks of"
                             f" {src.block_size}/{dst.block_size} tokens")
        si = torch.tensor(src_blocks[:n], dtype=torch.long)
        di = torch.tensor(dst_blocks[:n], dtype=torch.long)
        with torch.inference_mode():
            for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches, strict=True):
                dk.index_copy_(0, di, sk.index_select(0, si).to(dk.device))
                dv.index_copy_(0, di, sv.index_select(0, si).to(dv.device))
