"""torch.distributed.checkpoint (DCP) glue: boxes of global tensors in, no pickle out.

`Boxes` is a rank's set of rectangular pieces of one global tensor. It implements
DCP's checkpointable protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, the one DTensor implements), so DCP writes each box with its
offsets into the global tensor and, on load, fills each box from whichever saved
chunks overlap it: resharding is DCP's. It is a tensor subclass only so that DCP's
planners treat it as a tensor; no operation runs on it.

DCP's FileSystemReader unpickles `.metadata` with plain pickle, and its default
planner would unpickle non-tensor entries with torch.load(weights_only=False).
`SafeReader` unpickles the metadata allowing only DCP's own metadata classes, and
`TensorsOnlyLoadPlanner` refuses any non-tensor entry, so loading a checkpoint never
runs code from the file. The tensors themselves DCP reads with weights_only=True.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from minigpt.errors import ConfigError


class Boxes(torch.Tensor):
    """Pieces (offsets, tensor) of a global tensor of `shape`, for DCP to write or fill."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        device = pieces[0][1].device if pieces else torch.device("cpu")
        boxes = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        boxes.pieces = [(torch.Size(offsets), tensor) for offsets, tensor in pieces]
        return boxes

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not defined on checkpoint Boxes")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Boxes({tuple(self.shape)}, {len(self.pieces)} pieces)"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, tensor.shape), properties, self.shape),
            )
            for offsets, tensor in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, tensor.shape) for offsets, tensor in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, tensor in self.pieces:
            if offsets == index.offset:
                return tensor
        raise ValueError(f"no box of {index.fqn} starts at {tuple(index.offset or ())}")


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, whose metadata is unpickled with DCP's own classes only."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path.name} holds a {type(metadata).__name__}, not DCP metadata")
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # the saving run's id and path are not needed
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """The default planner, refusing entries that are not tensors (DCP would unpickle them)."""

    def load_bytes(self, read_item, value) -> None:
        raise ConfigError(f"checkpoint entry {read_item.dest_index.fqn} is not a tensor: refusing to unpickle it")


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP metadata, or ConfigError when it is missing or not DCP's."""
    try:
        return SafeReader(path).read_metadata()
    except Exception as error:  # a missing, truncated, foreign or malicious file
        raise ConfigError(
            f"checkpoint {path} is corrupt: cannot read its tensor metadata ({type(error).__name__}: "
            f"{' '.join(str(error).split())}): "  # one line, whatever the unpickler's message holds
            f"use another checkpoint"
        ) from None


def check_tensors(path: Path, metadata: Metadata, wanted: dict[str, tuple[int, ...]]) -> None:
    """Every tensor `wanted` is in the checkpoint with that shape, its chunks in bounds and adding up to it."""
    stored = metadata.state_dict_metadata
    for key, shape in wanted.items():
        entry = stored.get(key)
        problem = None
        if not isinstance(entry, TensorStorageMetadata):
            problem = "is missing" if entry is None else "is not a tensor"
        elif tuple(entry.size) != tuple(shape):
            problem = f"has shape {tuple(entry.size)}, not {tuple(shape)}"
        elif not entry.properties.dtype.is_floating_point:
            problem = f"has dtype {entry.properties.dtype}"
        else:
            inside = all(
                len(chunk.offsets) == len(shape)
                and all(0 <= o and o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape))
                for chunk in entry.chunks
            )
            covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if not inside or covered != math.prod(shape):
                problem = f"has chunks covering {covered} of {math.prod(shape)} elements"
            elif any(MetadataIndex(key, chunk.offsets) not in metadata.storage_data for chunk in entry.chunks):
                problem = "has chunks with no stored data"
        if problem:
            raise ConfigError(f"checkpoint {path} is corrupt: tensor {key} {problem}: use another checkpoint")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or "/" in name or not (path / name).is_file():
            raise ConfigError(f"checkpoint {path} is truncated: data file {name!r} is missing: use another checkpoint")
