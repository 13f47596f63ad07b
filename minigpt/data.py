"""Bytes in, bytes out: the tokenizer, the corpus, and deterministic batches.

The default tokenizer is the identity on UTF-8 bytes (vocabulary 256), so any text
round-trips exactly; minigpt/tokenizer.py puts it and a Hugging Face tokenizer.json behind one
interface, and a Corpus is loaded in either's ids (int16 or int32 above 255). A batch is a
pure function of (seed, step, micro-batch, data-parallel rank): every sample of a step's global batch is drawn from
(seed, step) alone, and a rank's micro-batch is a fixed slice of that global
batch, so any parallel layout sees exactly the same global batch as one process.

Token streams and batches are CPU torch tensors (uint8 tokens, int64 batches); the
random offsets come from a torch.Generator seeded by a hash of (seed, stream, step).
torch is imported inside the functions that make tensors, so that the torch-free job
description (job/train_config.py) can take VOCAB_SIZE and BatchLayout from here.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.errors import ConfigError

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 256
CORPUS_NAME = "shakespeare.txt.gz"
CORPUS_SHA256 = "b8cc995313d92e0132bd8fffdb45d7e822ab554fcf3ffb442a2777a7a73e2c88"
VAL_FRACTION = 0.1


def tokens_of(data: bytes):
    """Bytes to token ids: a CPU uint8 tensor of its own (writable) memory."""
    import torch

    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def encode(text: str):
    """Text to token ids (its UTF-8 bytes), as a uint8 tensor."""
    return tokens_of(text.encode("utf-8"))


def decode(tokens) -> str:
    """Token ids back to text. Exact for the encoding of any text; a byte
    sequence cut inside a multi-byte character decodes with U+FFFD."""
    values = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


def embedded_corpus() -> bytes:
    """The default corpus shipped with the package (see minigpt/corpus/NOTICE.md)."""
    raw = resources.files("minigpt").joinpath("corpus", CORPUS_NAME).read_bytes()
    text = gzip.decompress(raw)
    digest = hashlib.sha256(text).hexdigest()
    if digest != CORPUS_SHA256:
        raise ConfigError(f"the embedded corpus is damaged (sha256 {digest}); reinstall minigpt")
    return text


def check_data_file(path: str | Path) -> None:
    """ConfigError unless `path` names a file (a name the file system refuses: said so)."""
    try:
        there = Path(path).is_file()
    except (OSError, ValueError) as error:  # too long, a NUL
        raise ConfigError(f"cannot read data file {str(path)!r}: {getattr(error, 'strerror', None) or error}") from None
    if not there:
        raise ConfigError(f"data file {str(path)!r} does not exist or is not a file")


def read_text_file(path: str | Path) -> bytes:
    """A UTF-8 text file's bytes, or ConfigError saying why it cannot be used (any bytes: the tokenizer
    takes every UTF-8 text, so a file is refused only for not being one, or for being unreadable)."""
    check_data_file(path)
    path = Path(path)
    try:
        data = path.read_bytes()
    except (OSError, ValueError) as error:  # unreadable
        raise ConfigError(f"cannot read data file {str(path)!r}: {getattr(error, 'strerror', None) or error}") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"data file {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    return data


def check_length(n_tokens: int, seq_len: int, source: str, unit: str = "bytes") -> None:
    """Each split must hold at least one full sample: seq_len inputs plus one target."""
    needed = math.ceil((seq_len + 1) / VAL_FRACTION)
    if n_tokens < needed:
        raise ConfigError(
            f"data {source!r} has {n_tokens} {unit}; with seq_len={seq_len} it needs at least "
            f"{needed} so that the validation split (last {VAL_FRACTION:.0%}) holds one sequence: "
            f"use a longer file or a shorter --seq-len"
        )


def check_text_file(path: str | Path, seq_len: int, tokenizer=None) -> None:
    """Everything about --data that can be known before training: a text file exists, is UTF-8, and is long enough
    for seq_len (in `tokenizer`'s tokens: minigpt/tokenizer.py; None: bytes); a token directory (`minigpt tokenizer
    encode`) is whole, was encoded by `tokenizer`, is long enough and holds no id past its vocabulary."""
    if is_token_dir(path):
        tokens = token_stream(path, tokenizer)
        check_length(len(tokens), seq_len, str(path), "tokens")
        vocab = tokenizer.vocab_size if tokenizer is not None else VOCAB_SIZE
        largest = max((int(tokens[i:i + SCAN_CHUNK].max()) for i in range(0, len(tokens), SCAN_CHUNK)), default=0)
        if largest >= vocab:
            raise ConfigError(f"data {str(path)!r} holds token id {largest}, past its tokenizer's vocabulary of "
                              f"{vocab}: the file is damaged; encode the text again")
        return
    data = read_text_file(path)
    if tokenizer is None or tokenizer.spec == "bytes":
        check_length(len(data), seq_len, str(path))
    else:
        check_length(len(tokenizer.encode(data.decode("utf-8"))), seq_len, str(path), "tokens")


@dataclass(frozen=True)
class Corpus:
    """A token stream split into train (first 90%) and validation (last 10%); of several sources, a Mixture of
    theirs."""

    train: torch.Tensor  # uint8 bytes; int16 or int32 ids of another tokenizer; or a Mixture
    val: torch.Tensor
    source: str

    @classmethod
    def load(cls, path, seq_len: int, tokenizer=None, weights: tuple[float, ...] = ()) -> "Corpus":
        """The text of `path` (None or (): the embedded corpus; a tuple of several: their Mixture, in `weights`'
        shares, or their training tokens' where none are given) in `tokenizer`'s ids (minigpt/tokenizer.py; None:
        bytes)."""
        if isinstance(path, (tuple, list)) and len(path) > 1:
            parts = [cls.load(one, seq_len, tokenizer) for one in path]
            shares = mixture_shares(weights or [len(part.train) for part in parts])
            source = " + ".join(f"{part.source} ({share:.3g})" for part, share in zip(parts, shares))
            short = tuple(Path(one).name for one in path)  # each source's name: its file's, or where two share one,
            names = short if len(set(short)) == len(short) else tuple(str(one) for one in path)  # its whole path
            return cls(train=Mixture(tuple(part.train for part in parts), shares, names),
                       val=Mixture(tuple(part.val for part in parts), shares, names), source=source)
        if isinstance(path, (tuple, list)):
            path = path[0] if path else None
        source = "embedded:" + CORPUS_NAME if path is None else str(path)
        if path is not None and is_token_dir(path):  # already encoded: memory-mapped, read as batches need it
            tokens, unit = token_stream(path, tokenizer), "tokens"
        else:
            data = embedded_corpus() if path is None else read_text_file(path)
            unit = "bytes" if tokenizer is None or tokenizer.spec == "bytes" else "tokens"
            tokens = tokens_of(data) if unit == "bytes" else tokenizer.encode(data.decode("utf-8"))
        check_length(len(tokens), seq_len, source, unit)
        split = len(tokens) - int(len(tokens) * VAL_FRACTION)
        return cls(train=tokens[:split], val=tokens[split:], source=source)


# A token directory (`minigpt tokenizer encode`): DIR/tokens.bin, the ids one after another (little-endian, the
# narrowest unsigned type the vocabulary fits), and DIR/tokens.json, written last, naming the tokenizer that encoded
# them (its fingerprint), their type and count and the texts they came from (and the end-of-document token, where
# one ends each document); DIR/tokenizer.json, the tokenizer itself.
TOKENS_HEADER, TOKENS_FILE, TOKENS_FORMAT = "tokens.json", "tokens.bin", "minigpt-tokens"
TOKEN_TYPES = {"uint8": 1, "uint16": 2, "uint32": 4}
SCAN_CHUNK = 1 << 26  # ids read at a time where a whole stream is checked


def token_type(vocab_size: int) -> str:
    """The narrowest unsigned type holding every id of a vocabulary."""
    return next(name for name, size in TOKEN_TYPES.items() if vocab_size <= 256 ** size)


def is_token_dir(path) -> bool:
    """Whether `path` names a token directory (a name the file system refuses does not: the text reader says why)."""
    try:
        return path is not None and Path(path).is_dir() and (Path(path) / TOKENS_HEADER).is_file()
    except (OSError, ValueError):  # too long, a NUL
        return False


def document_end(sources) -> int:
    """The end-of-document id every source of `sources` (token directories) was encoded with (`minigpt tokenizer
    encode --eod`); ConfigError (one line) where one is no token directory, has none or another."""
    ends = {}
    for path in sources:
        if not is_token_dir(path):
            raise ConfigError(f"--document-mask needs token directories whose documents end in a token: {str(path)!r} "
                              f"is not one (`minigpt tokenizer encode --eod TOKEN` writes one)")
        eod = token_header(path).get("eod")
        if not (isinstance(eod, dict) and isinstance(eod.get("id"), int) and eod["id"] >= 0):
            raise ConfigError(f"--document-mask: the documents of {str(path)!r} end in no token (encode them with "
                              f"`minigpt tokenizer encode --eod TOKEN`)")
        ends[str(path)] = eod["id"]
    if not ends:
        raise ConfigError("--document-mask needs --data: token directories whose documents end in a token (the "
                          "embedded corpus is one text)")
    if len(set(ends.values())) > 1:
        raise ConfigError(f"--document-mask: the sources end their documents in different ids ({ends}): encode them "
                          f"with one --eod")
    return next(iter(ends.values()))


def documents_words(sources) -> str:
    """'ended by id 0, 62 tokens on average': the end-of-document id of token directories `sources` (document_end)
    and their documents' mean length from their headers' counts (what `minigpt simulate --document-length` takes;
    left out where a source does not count its documents)."""
    ended = f"ended by id {document_end(sources)}"
    counted = [source for path in sources for source in token_header(path).get("sources") or [{}]]
    if not all(isinstance(source.get(key), int) for source in counted for key in ("documents", "tokens")):
        return ended
    documents = sum(source["documents"] for source in counted)
    mean = sum(source["tokens"] for source in counted) / documents if documents else None
    return ended if mean is None else f"{ended}, {mean:,.0f} tokens on average"


def token_header(path) -> dict:
    """DIR/tokens.json, checked against DIR/tokens.bin's size; ConfigError (one line) saying what is wrong."""
    def refuse(why: str) -> None:
        raise ConfigError(f"data {str(path)!r} is not a whole token directory: {why} (`minigpt tokenizer encode` "
                          f"writes one)")
    try:
        header = json.loads((Path(path) / TOKENS_HEADER).read_text(encoding="utf-8"))
        size = (Path(path) / TOKENS_FILE).stat().st_size
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:  # (JSON nested past Python's stack)
        refuse(f"{TOKENS_HEADER} or {TOKENS_FILE} cannot be read ({getattr(error, 'strerror', None) or error})")
    if not isinstance(header, dict) or header.get("format") != TOKENS_FORMAT or header.get("version") != 1:
        refuse(f"{TOKENS_HEADER} is not a {TOKENS_FORMAT} version 1 header")
    count, kind, tokenizer = header.get("tokens"), header.get("dtype"), header.get("tokenizer")
    whole = isinstance(count, int) and not isinstance(count, bool) and count >= 0
    if not (isinstance(kind, str) and kind in TOKEN_TYPES and whole and isinstance(tokenizer, dict)
            and isinstance(tokenizer.get("fingerprint"), str)):
        refuse(f"{TOKENS_HEADER} lacks a dtype ({', '.join(TOKEN_TYPES)}), a token count or the tokenizer's "
               f"fingerprint")
    if size != count * TOKEN_TYPES[kind]:
        refuse(f"{TOKENS_FILE} has {size:,} bytes, the header's {count:,} {kind} ids {count * TOKEN_TYPES[kind]:,}")
    return header


def token_stream(path, tokenizer=None):
    """DIR/tokens.bin as a read-only numpy memory map, after its header's checks and that `tokenizer` (None: bytes)
    is the one that encoded it; ConfigError otherwise."""
    import numpy as np

    header = token_header(path)
    fingerprint = "bytes" if tokenizer is None else tokenizer.fingerprint
    if header["tokenizer"]["fingerprint"] != fingerprint:
        raise ConfigError(f"data {str(path)!r} was encoded by the tokenizer {header['tokenizer'].get('name')!r}, not "
                          f"the run's ({'bytes' if tokenizer is None else tokenizer.spec}): leave --tokenizer out to "
                          f"train with the data's own, or encode the text with the run's")
    if header["tokens"] == 0:
        return np.zeros(0, dtype=header["dtype"])
    return np.memmap(Path(path) / TOKENS_FILE, dtype=np.dtype(header["dtype"]).newbyteorder("<"), mode="r")


TRAIN_STREAM, VAL_STREAM = 0, 1


def generator_seed(seed: int, stream: int, step: int) -> int:
    """A 63-bit seed that depends on all three numbers (sha256 of them: no two triples collide in practice)."""
    digest = hashlib.sha256(f"{seed}:{stream}:{step}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_offsets(n_tokens: int, seq_len: int, seed: int, step: int, n_samples: int, stream: int = TRAIN_STREAM):
    """Start offsets (int64 tensor) of the samples of one global batch: a pure function of (seed, stream, step)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(generator_seed(seed, stream, step))
    return torch.randint(0, n_tokens - seq_len, (n_samples,), generator=generator, device="cpu")


def slice_samples(tokens, offsets, seq_len: int):
    """(inputs, targets), each (len(offsets), seq_len) int64: targets are inputs shifted by one."""
    import torch

    window = offsets[:, None] + torch.arange(seq_len + 1, device="cpu")[None, :]
    if not isinstance(tokens, torch.Tensor):  # a token directory's memory map: the windows read from it alone
        import numpy as np

        chunk = torch.from_numpy(np.asarray(tokens[window.numpy()], dtype=np.int64))
    else:
        chunk = tokens[window].long()
    return chunk[:, :-1], chunk[:, 1:]


@dataclass(frozen=True)
class BatchLayout:
    """How one step's global batch is cut: into micro-batches, then across data-parallel ranks."""

    global_batch: int
    micro_batches: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.global_batch <= 0 or self.micro_batches <= 0 or self.dp_size <= 0:
            raise ConfigError(
                f"global batch, micro-batches and data-parallel size must be positive, got "
                f"{self.global_batch}, {self.micro_batches}, {self.dp_size}"
            )
        if self.global_batch % (self.micro_batches * self.dp_size):
            raise ConfigError(
                f"global batch {self.global_batch} is not divisible by micro-batches x dp = "
                f"{self.micro_batches} x {self.dp_size}: choose a multiple of {self.micro_batches * self.dp_size}"
            )

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch on one data-parallel rank."""
        return self.global_batch // (self.micro_batches * self.dp_size)

    def sample_range(self, micro_batch: int, dp_rank: int) -> range:
        """Which samples of the global batch (micro-batch major, then rank) one rank gets."""
        start = (micro_batch * self.dp_size + dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


GOLDEN = (math.sqrt(5) - 1) / 2  # the golden ratio's conjugate: the Weyl sequence that spreads a mixture's sources


def mixture_shares(weights) -> tuple[float, ...]:
    """Weights (positive, finite) as shares summing to 1; ConfigError for others."""
    if not weights or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0
                          for w in weights):
        raise ConfigError(f"--data-weights must be numbers above 0, one per --data, got {list(weights)!r}")
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


@dataclass(frozen=True)
class Mixture:
    """Several token streams drawn from in fixed shares (Megatron's blended datasets, stateless). Sample n of the
    stream's sequence (its step times the batch, plus its place) comes from source i where frac((n + 1/2) x phi)
    falls in [W_{i-1}, W_i), W the shares' running sums and phi the golden ratio's conjugate: a Weyl sequence, so the
    first N samples (and any N in a row) hold each source within a few samples of its share, and a sample's source
    is a function of n alone. Its offset in that source is drawn from (seed, step, source): every layout and every
    resumed run reads the same samples. A corpus's validation Mixture is its sources' validation splits, each
    evaluated on its own batches (parallel/run/train.py's evaluate)."""

    streams: tuple
    shares: tuple[float, ...]
    names: tuple[str, ...] = ()  # each source's: its file's name, or its path where two share a name

    def sources(self, first: int, count: int):
        """The source of samples first .. first + count - 1 (an int64 tensor)."""
        import torch

        bounds = torch.tensor([math.fsum(self.shares[:i + 1]) for i in range(len(self.shares) - 1)],
                              dtype=torch.float64)
        place = torch.frac((torch.arange(first, first + count, dtype=torch.float64) + 0.5) * GOLDEN)
        return torch.bucketize(place, bounds, right=True)

    def samples(self, seq_len: int, seed: int, step: int, count: int, chosen: range):
        """(inputs, targets) of the samples `chosen` of a batch of `count` drawn at `step`."""
        import torch

        sources = self.sources(step * count, count)
        inputs = torch.empty(len(chosen), seq_len, dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for i, tokens in enumerate(self.streams):
            picked = (sources == i).nonzero().squeeze(1)  # this source's samples of the batch, in order
            offsets = sample_offsets(len(tokens), seq_len, seed, step, len(picked), 2 + i)  # past TRAIN and VAL
            keep = [(row, offset) for row, offset in zip(picked.tolist(), offsets) if row in chosen]
            if keep:
                rows = torch.tensor([row - chosen.start for row, _ in keep])
                x, y = slice_samples(tokens, torch.stack([offset for _, offset in keep]), seq_len)
                inputs[rows], targets[rows] = x, y
        return inputs, targets


def get_batch(
    tokens,
    seq_len: int,
    layout: BatchLayout,
    seed: int,
    step: int,
    micro_batch: int = 0,
    dp_rank: int = 0,
) -> tuple:
    """One rank's micro-batch of one step: a pure function of (seed, step, micro_batch, dp_rank)."""
    chosen = layout.sample_range(micro_batch, dp_rank)
    if isinstance(tokens, Mixture):
        return tokens.samples(seq_len, seed, step, layout.global_batch, chosen)
    offsets = sample_offsets(len(tokens), seq_len, seed, step, layout.global_batch)
    return slice_samples(tokens, offsets[chosen.start : chosen.stop], seq_len)


def validation_batches(tokens, seq_len: int, batch_size: int, n_batches: int, seed: int):
    """A fixed set of validation batches (the same at every evaluation)."""
    for index in range(n_batches):
        offsets = sample_offsets(len(tokens), seq_len, seed, index, batch_size, stream=VAL_STREAM)
        yield slice_samples(tokens, offsets, seq_len)
