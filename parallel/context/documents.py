"""Document masks under context parallelism.

A token's document counts the ends of documents before it along the whole sequence, and a rank holds two chunks
of each (parallel/context/chunks.py), so every rank of the group gathers the sequences' token ids once per
micro-batch (integers, small beside one layer's keys) and numbers the documents of the whole sequences; each
attention block then compares its query chunk's ids with its key chunk's (`chunk_documents`), as torchtitan's
block-causal mask does per block.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from minigpt.attention import document_ids, same_document
from parallel.comm import all_gather_flat
from parallel.context.chunks import whole_sequence


def sequence_documents(eod: int, group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A rank's (batch, its tokens) input ids -> the (batch, whole sequence) document ids of their sequences;
    `group`: the context-parallel group (None: the rank holds whole sequences)."""
    if group is None:
        return functools.partial(document_ids, eod=eod)

    def whole(tokens: torch.Tensor) -> torch.Tensor:
        cp = dist.get_world_size(group)
        gathered = torch.empty((cp * tokens.shape[0], *tokens.shape[1:]), dtype=tokens.dtype, device=tokens.device)
        all_gather_flat(gathered, tokens.contiguous(), group=group)  # along the batch: every rank's part in turn
        return document_ids(whole_sequence(list(gathered.chunk(cp)), dim=1), eod)

    return whole


def chunk_documents(documents: torch.Tensor | None, query_chunk: int, key_chunk: int, c: int) -> torch.Tensor | None:
    """(batch, c, c) bools: whether query chunk `query_chunk`'s tokens share a document with key chunk
    `key_chunk`'s (chunks c long along the whole sequence); None without documents."""
    if documents is None:
        return None
    queries, keys = (documents[:, chunk * c:(chunk + 1) * c] for chunk in (query_chunk, key_chunk))
    return same_document(queries, keys)
