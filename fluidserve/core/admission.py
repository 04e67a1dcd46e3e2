"""Whether a request can ever run: shared by the scheduler and the HTTP front end, which
checks before it hands a request to an engine core in another process."""

from __future__ import annotations


def admissible_blocks(num_blocks: int, watermark: float) -> int:
    """KV blocks a single request may hold: all but the watermark kept free at admission."""
    return num_blocks - int(watermark * num_blocks)


def cache_blocks(per_token_bytes: int, block_size: int, memory_gb: float,
                 max_seqs: int | None = None, max_len: int | None = None,
                 watermark: float = 0.0) -> int:
    """Blocks of ``block_size`` tokens that fit ``memory_gb`` at ``per_token_bytes`` (one
    worker's share), but no more than ``max_seqs`` sequences of ``max_len`` tokens can fill
    with the admission watermark kept free: the scheduler never runs more sequences than
    that, so such blocks would only be allocated and zeroed."""
    blocks = max(1, int(memory_gb * (1 << 30) // (per_token_bytes * block_size)))
    if max_seqs and max_len:
        need = max_seqs * -(-max_len // block_size)
        usable = int(need / (1.0 - watermark))
        while admissible_blocks(usable, watermark) < need:
            usable += 1
        blocks = min(blocks, usable)
    return blocks


def cache_room(num_prompt_tokens: int, block_size: int, num_admissible_blocks: int) -> int:
    """The most output tokens the cache can ever hold for this prompt (the last output token
    is sampled, never stored); below 1 when the prompt alone does not fit."""
    return num_admissible_blocks * block_size - num_prompt_tokens + 1


def admission_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                    block_size: int, num_admissible_blocks: int) -> str | None:
    """Why a request of this size can never run, or None if it can."""
    if num_prompt_tokens == 0:
        return "the prompt is empty"
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total}"
                f" exceeds the context window of {max_model_len} tokens")
    stored = total - 1  # the last output token is sampled, never fed back: no KV
    need = -(-stored // block_size)
    if need > num_admissible_blocks:
        return (f"request needs {need} KV blocks for {stored} tokens (its prompt and all but"
                f" its last output token) but the cache has {num_admissible_blocks} admissible"
                " blocks")
    return None
