"""A Hugging Face model directory, read and written: config.json and the weights in safetensors.

Reading takes model.safetensors, or the shards a model.safetensors.index.json lists (how transformers saves a
model past its shard size). A directory is checked from its headers alone (`check_hf_dir`: the shape, every
tensor's name and shape) before any rank starts; `read_hf_dir` then loads the tensors, block-wise fp8 weights
(DeepSeek-V3's and Kimi K2's releases) multiplied out by their scales. Writing goes to a
temporary directory beside the target, renamed into place when complete: a failed export leaves nothing, and an
existing directory that is not empty is never written into.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.hf.layouts import config_from_hf, from_hf, hf_config, lookup, to_hf, unfused

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"


def read_config(path: Path) -> dict:
    """config.json of the model directory `path`, as a dict; ConfigError saying what is wrong."""
    if not path.is_dir():
        raise ConfigError(f"{str(path)!r} is not a directory: give a Hugging Face model directory (config.json and "
                          f"model.safetensors)")
    if not (path / CONFIG).is_file():
        raise ConfigError(f"{str(path)!r} has no {CONFIG}: it is not a Hugging Face model directory")
    return read_config_file(path / CONFIG)


def read_config_file(path: Path) -> dict:
    """A transformers config.json at `path`, as a dict; ConfigError saying what is wrong."""
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"{path} cannot be read as JSON ({' '.join(str(error).split())})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return hf


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the model's weights: model.safetensors, or the index's shards."""
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if (path / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"{path / INDEX} is unreadable ({' '.join(str(error).split())})") from None
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise ConfigError(f"{path / INDEX} lists {missing[0]}, which is not in {str(path)!r}")
        return [path / name for name in shards]
    raise ConfigError(f"{str(path)!r} has no {WEIGHTS} (minigpt reads safetensors weights only)")


def headers(files: list[Path]) -> dict[str, list[int]]:
    """Every tensor's shape, read from the files' headers (no tensor loaded)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes |= {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except Exception as error:  # safetensors raises its own SafetensorError on a damaged file
            raise ConfigError(f"{file} is not a readable safetensors file ({' '.join(str(error).split())[:160]})"
                              ) from None
    return shapes


def expected_shapes(config: GPTConfig) -> dict[str, list[int]]:
    """The shape of every transformers tensor of `config`, from an empty model's state on the meta device."""
    import torch

    from minigpt.model import GPT

    with torch.device("meta"):
        state = GPT(config).state_dict()
    return {name: list(tensor.shape) for name, tensor in to_hf(state, config).items()}


def fp8_blocks(hf: dict) -> tuple[int, int] | None:
    """The weight block of transformers' fine-grained fp8 checkpoints (quantization_config quant_method "fp8" with a
    weight_block_size: DeepSeek-V3's and Kimi K2's released weights), None for unquantized weights; ConfigError for
    any other quantization (minigpt trains from full-precision weights)."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if not (isinstance(quantization, dict) and quantization.get("quant_method") == "fp8" and isinstance(block, list)
            and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ConfigError(f"its weights are quantized ({method!r}): minigpt reads full-precision weights and "
                          f"transformers' block-wise fp8 ones (quant_method 'fp8' with a weight_block_size)")
    return block[0], block[1]


def scaled_weights(names) -> dict[str, str]:
    """{a block-wise fp8 weight's weight_scale_inv: that weight's name} of the tensor `names`."""
    return {name: name[: -len("_scale_inv")] for name in names if name.endswith(".weight_scale_inv")}


def scale_shape(weight: list[int], block: tuple[int, int]) -> list[int]:
    """The shape of a block-wise fp8 weight's weight_scale_inv: one scale per block, the last blocks partial."""
    return [-(-weight[0] // block[0]), -(-weight[1] // block[1])]


def dequantized(tensors: dict, block: tuple[int, int]) -> dict:
    """`tensors` with every block-wise fp8 weight (a `.weight` beside its `.weight_scale_inv`) multiplied out in fp32,
    each block by its scale (DeepSeek's weight_dequant; transformers' own dequantization gives the same values), and
    the scales dropped; ConfigError on a scale of the wrong shape."""
    out = dict(tensors)
    for name, weight_name in scaled_weights(tensors).items():
        weight, scale = out[weight_name], out.pop(name)
        if list(scale.shape) != scale_shape(list(weight.shape), block):
            raise ConfigError(f"{name} is {list(scale.shape)}, its weight's {list(weight.shape)} blocks of {block} "
                              f"make it {scale_shape(list(weight.shape), block)}")
        rows, cols = weight.shape
        full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[weight_name] = weight.float() * full
    return out


def check_hf_dir(path: str | os.PathLike) -> GPTConfig:
    """The model shape of directory `path`, after checking that its weights hold every tensor of that shape at the
    right size (headers only; a block-wise fp8 weight with its scales); ConfigError, one line, on anything minigpt
    cannot load."""
    path = Path(path)
    hf = read_config(path)
    block, found = fp8_blocks(hf), headers(weight_files(path))
    config = with_held_modules(config_from_hf(hf), found)
    for name, weight_name in scaled_weights(found).items():
        weight = found.get(weight_name)
        if block is None or weight is None or found[name] != scale_shape(weight, block):
            raise ConfigError(f"{str(path)!r}: {name} is not the block scales of an fp8 weight this config.json "
                              f"describes")
    found = unfused(found, config)
    for name, shape in expected_shapes(config).items():
        have = lookup(found, name)
        if have is None:
            raise ConfigError(f"{str(path)!r}: the weights have no {name}, which a {hf.get('model_type')} model "
                              f"of this config.json has")
        if have != shape:
            raise ConfigError(f"{str(path)!r}: {name} is {have}, this config.json makes it {shape}")
    return config


def with_held_modules(config: GPTConfig, found: dict) -> GPTConfig:
    """`config` with the multi-token prediction modules the weights (`found`: tensors or shapes by name) hold:
    transformers' own DeepSeek-V3 checkpoints leave them out while their config.json still counts them
    (num_nextn_predict_layers), and are read without them, as transformers reads them."""
    if config.mtp_depth and lookup(found, f"model.layers.{config.n_layers}.eh_proj.weight") is None:
        return config.with_(mtp_depth=0)
    return config


def read_hf_dir(path: str | os.PathLike, config: GPTConfig) -> dict:
    """Our plain GPT's fp32 state from directory `path` (checked first with check_hf_dir)."""
    from safetensors.torch import load_file

    tensors, block = {}, fp8_blocks(read_config(Path(path)))
    for file in weight_files(Path(path)):
        tensors |= load_file(str(file))
    return from_hf(dequantized(tensors, block) if block else tensors, config)


def check_new_dir(out: str | os.PathLike, flag: str = "") -> Path:
    """`out` as a Path, when it is new or an empty directory; ConfigError otherwise (nothing is ever overwritten)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{flag + ' ' if flag else ''}{str(out)!r} exists and is not an empty directory: give a new "
                          f"one (nothing is overwritten)")
    return out


def write_hf_dir(state: dict, config: GPTConfig, out: str | os.PathLike,
                 extra: dict[str, Path | bytes] | None = None) -> Path:
    """Directory `out` made with config.json, model.safetensors and the `extra` files (name -> a file to copy or
    the bytes to write, such as a tokenizer's), whole or not at all. Refused: an `out` that exists and is not an empty directory."""
    from safetensors.torch import save_file

    out = check_new_dir(out)
    if not out.parent.is_dir():
        raise ConfigError(f"the directory {str(out.parent)!r} that would hold {out.name!r} does not exist")
    tensors = to_hf(state, config)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(temporary / WEIGHTS), metadata={"format": "pt"})
        (temporary / CONFIG).write_text(json.dumps(hf_config(config), indent=2) + "\n", encoding="utf-8")
        for name, source in (extra or {}).items():
            if isinstance(source, bytes):
                (temporary / name).write_bytes(source)
            else:
                shutil.copyfile(source, temporary / name)
        if out.exists():
            out.rmdir()  # empty, checked above
        temporary.rename(out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return out

