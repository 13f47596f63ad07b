"""The load-balanced split of a sequence over a context-parallel group.

Causal attention's work grows along the sequence: the last query attends to every key, the first to one.
Cut into cp contiguous pieces, the last rank would do 2cp - 1 times the first one's work. So the sequence
is cut into 2 cp chunks of equal length and rank i holds chunks i and 2 cp - 1 - i (the split Megatron-core,
torchtitan and Llama 3 use): every rank then holds one early and one late chunk and the same work.
"""

from __future__ import annotations

import torch


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def check_split(seq: int, cp: int) -> int:
    """The chunk length; ValueError when the sequence does not split into 2 cp equal chunks."""
    if cp < 1 or seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    return seq // (2 * cp)


def local_part(x: torch.Tensor, rank: int, cp: int, dim: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence), concatenated in chunk order."""
    check_split(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(rank, cp)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def positions(rank: int, cp: int, seq: int, device: torch.device | None = None) -> torch.Tensor:
    """The true positions (0 .. seq - 1) of this rank's tokens, in the order local_part keeps them."""
    return local_part(torch.arange(seq, device=device), rank, cp, 0)


def whole_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The sequence from every rank's local_part (listed by rank): the inverse of local_part."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
