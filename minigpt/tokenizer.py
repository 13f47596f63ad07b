"""Tokenizers: the byte tokenizer, or a Hugging Face tokenizer.json read with the `tokenizers` library.

`load_tokenizer(spec)` takes "bytes" (minigpt/data.py's identity on UTF-8 bytes, vocabulary 256: the default)
or the path of a tokenizer.json (or of a directory holding one). Both answer one small interface:
encode(text) -> a CPU tensor of token ids (uint8 for bytes, int16 or int32 otherwise, so ids above 255 fit),
decode(ids) -> str, vocab_size, spec (what was loaded: "bytes" or the file's path), fingerprint (the sha256 of
the tokenizer's canonical JSON: two files describing one tokenizer share it), to_json() and save(directory),
which writes DIRECTORY/tokenizer.json. The byte tokenizer saves as its exact equivalent: a byte-level BPE
without merges whose ids are the bytes, so an exported model of any run can carry a tokenizer.json.

`train_bpe(text, vocab_size, special)` trains a byte-level BPE (GPT-2's byte-to-character mapping, whose 256
characters are the initial alphabet), so every text round-trips exactly; `special` tokens (an end-of-document one)
take its first ids. `write_token_dir` encodes text files, or JSON Lines documents, into a token directory, an
end-of-document id after each document where asked. A file that does not parse is a ConfigError
(one line). tokenizers and torch are imported inside the functions that use them: the job description
(job/train_config.py) checks a run's tokenizer without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property, lru_cache
from pathlib import Path

from minigpt.data import VOCAB_SIZE, decode as decode_bytes, encode as encode_bytes
from minigpt.errors import ConfigError, check_path_given

BYTES = "bytes"
FILE_NAME = "tokenizer.json"
MAX_FILE_BYTES = 2**30  # a tokenizer.json of Llama 3's 128K tokens has 9 MB; anything past this is not one
MIN_BPE_VOCAB = VOCAB_SIZE + 1  # the 256 bytes and at least one merge
MAX_BPE_VOCAB = 2**20  # GPT-4o's is 200K: a million tokens is past any tokenizer in use


class ByteTokenizer:
    """The identity on UTF-8 bytes (minigpt/data.py): vocabulary 256, every text round-trips."""

    spec = name = BYTES
    vocab_size = VOCAB_SIZE

    def encode(self, text: str):
        return encode_bytes(text)

    def decode(self, ids) -> str:
        return decode_bytes(ids)

    def to_json(self) -> str:
        return byte_identity_json()

    @property
    def fingerprint(self) -> str:
        return BYTES

    def save(self, directory: str | os.PathLike) -> Path:
        return _save(self.to_json(), directory)

    def describe(self) -> dict:
        return {"name": BYTES, "vocab_size": self.vocab_size, "fingerprint": self.fingerprint}


class FileTokenizer:
    """A Hugging Face tokenizer (tokenizers.Tokenizer); `text` is the JSON it was read from, kept as written."""

    def __init__(self, hf, spec: str, text: str | None = None):
        self.hf, self.spec, self.name = hf, spec, spec
        self.text = hf.to_str() if text is None else text
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str):
        """The ids of `text` (no special tokens added: a corpus is one stream, a prompt goes on as written)."""
        import torch

        dtype = torch.int16 if self.vocab_size <= 2**15 else torch.int32
        return torch.tensor(self.hf.encode(text, add_special_tokens=False).ids, dtype=dtype)

    def decode(self, ids) -> str:
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.hf.decode([int(value) for value in values], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.text

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.hf.to_str().encode("utf-8")).hexdigest()

    def save(self, directory: str | os.PathLike) -> Path:
        return _save(self.text, directory)

    def describe(self) -> dict:
        return {"name": self.spec, "vocab_size": self.vocab_size, "fingerprint": self.fingerprint}


def _save(text: str, directory: str | os.PathLike) -> Path:
    path = Path(directory) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def tokenizer_file(spec: str | os.PathLike) -> Path:
    """The tokenizer.json a spec names: the file itself, or DIR/tokenizer.json; ConfigError when neither exists."""
    check_path_given("--tokenizer", str(spec), f"{BYTES!r} or a tokenizer.json's path")
    path = Path(spec)
    if path.is_dir():
        path = path / FILE_NAME
        if not path.is_file():
            raise ConfigError(f"--tokenizer {str(spec)!r} is a directory without a {FILE_NAME}: give the file, a "
                              f"directory holding one (`minigpt tokenizer train --out DIR` writes it), or {BYTES!r}")
    elif not path.is_file():
        raise ConfigError(f"--tokenizer {str(spec)!r} does not exist: give {BYTES!r}, a Hugging Face {FILE_NAME} "
                          f"or a directory holding one")
    return path


def load_tokenizer(spec: str | os.PathLike | None = None):
    """The tokenizer `spec` names (None: bytes); ConfigError, in one line, for a file that does not parse."""
    if spec is None or str(spec) == BYTES:
        return ByteTokenizer()
    path = tokenizer_file(spec)
    try:
        stat = path.stat()
    except OSError as error:
        raise ConfigError(f"cannot read --tokenizer {str(path)!r}: {error.strerror}") from None
    return _load_file(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _load_file(path: str, mtime_ns: int, size: int) -> FileTokenizer:
    """One file read once while it is unchanged (a run's settings are checked more than once)."""
    from tokenizers import Tokenizer

    if size > MAX_FILE_BYTES:
        raise ConfigError(f"--tokenizer {path!r} has {size:,} bytes, more than any {FILE_NAME} ({MAX_FILE_BYTES:,})")
    try:
        text = Path(path).read_bytes().decode("utf-8")
        hf = Tokenizer.from_str(text)
    except UnicodeDecodeError as error:
        raise ConfigError(f"--tokenizer {path!r} is not a {FILE_NAME}: not UTF-8 (byte {error.start})") from None
    except OSError as error:
        raise ConfigError(f"cannot read --tokenizer {path!r}: {error.strerror}") from None
    except Exception as error:  # tokenizers' own parse errors are plain Exceptions
        why = " ".join(str(error).split())[:200]
        raise ConfigError(f"--tokenizer {path!r} is not a Hugging Face {FILE_NAME} the tokenizers library reads "
                          f"({why})") from None
    if hf.get_vocab_size(with_added_tokens=True) < 1:
        raise ConfigError(f"--tokenizer {path!r} has an empty vocabulary")
    return FileTokenizer(hf, path, text)


def is_bytes(tokenizer) -> bool:
    """Whether `tokenizer` gives the byte tokenizer's ids for every text: it is it, or the tokenizer.json that
    ByteTokenizer.save writes (an exported byte run's)."""
    if isinstance(tokenizer, ByteTokenizer):
        return True
    from tokenizers import Tokenizer

    return tokenizer.fingerprint == hashlib.sha256(Tokenizer.from_str(byte_identity_json()).to_str()
                                                   .encode("utf-8")).hexdigest()


def model_vocab_size(spec: str | os.PathLike, given: int | None) -> int:
    """The model's vocabulary with tokenizer `spec`: its own, or `given` (--vocab-size) when that is at least it."""
    tokenizer = load_tokenizer(spec)
    if given is None:
        return tokenizer.vocab_size
    if isinstance(given, int) and not isinstance(given, bool) and given < tokenizer.vocab_size:
        raise ConfigError(f"--vocab-size {given} is smaller than the vocabulary of tokenizer {tokenizer.name!r} "
                          f"({tokenizer.vocab_size}): leave --vocab-size out (the model takes the tokenizer's) or "
                          f"give {tokenizer.vocab_size} or more")
    return given


def check_bpe_vocab(vocab_size: object) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise ConfigError(f"--vocab-size must be a whole number from {MIN_BPE_VOCAB} (the 256 bytes and one merge) "
                          f"to {MAX_BPE_VOCAB:,}, got {vocab_size!r}")
    return vocab_size


def byte_level(model):
    """A tokenizers.Tokenizer of `model` with the byte-level pre-tokenizer and decoder (no prefix space)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(text: str, vocab_size: int, special: tuple[str, ...] = ()) -> FileTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens trained on `text` (fewer when the text has no more pairs),
    the `special` tokens (an end-of-document token such as "<|endoftext|>") its first ids, never merged."""
    from tokenizers import models, pre_tokenizers, trainers

    check_bpe_vocab(vocab_size - len(special))
    tokenizer = byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=list(special))
    tokenizer.train_from_iterator([text], trainer=trainer)
    return FileTokenizer(tokenizer, "bpe")


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-to-character mapping (the byte-level pre-tokenizer's): printable bytes stand for themselves."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [byte for byte in range(256) if byte not in kept]
    return {**{byte: chr(byte) for byte in kept}, **{byte: chr(256 + n) for n, byte in enumerate(moved)}}


@lru_cache(maxsize=1)
def byte_identity_json() -> str:
    """The byte tokenizer as a tokenizer.json: a byte-level BPE without merges whose id of each byte is the byte."""
    from tokenizers import models

    chars = byte_to_char()
    return byte_level(models.BPE(vocab={chars[byte]: byte for byte in range(256)}, merges=[])).to_str()


# encoding text into a token directory (minigpt/data.py reads it): texts are read and encoded in pieces of about
# PIECE_CHARS characters, cut only at a line start where the tokenizer encodes the text around the cut (CUT_CONTEXT
# characters each side) as it encodes the two sides apart: the pieces' ids one after another are the whole text's
PIECE_CHARS, CUT_CONTEXT, READ_BYTES = 1 << 24, 1 << 10, 1 << 22


def eod_id(tokenizer, token: str | None) -> int | None:
    """The id of the end-of-document token `token` in `tokenizer` (None: none asked); ConfigError where it has none."""
    if token is None:
        return None
    if is_bytes(tokenizer):
        raise ConfigError(f"--eod {token!r}: the byte tokenizer's 256 ids are the bytes, none ends a document: use a "
                          f"tokenizer.json that has one (`minigpt tokenizer train --special {token!r}` makes one)")
    found = tokenizer.hf.token_to_id(token)
    if found is None:
        added = [t.content for t in tokenizer.hf.get_added_tokens_decoder().values()][:8]
        raise ConfigError(f"--eod {token!r} is not a token of {tokenizer.spec} (its special tokens: "
                          f"{', '.join(map(repr, added)) or 'none'})")
    return found


def write_token_dir(directory: str | os.PathLike, paths: list[str], tokenizer,
                    piece_chars: int = PIECE_CHARS, eod: str | None = None, jsonl: str | None = None) -> dict:
    """Encode the UTF-8 text files `paths` (each whole, one after another) with `tokenizer` into the token directory
    `directory` (new or empty), built beside it and renamed into place when complete; its header. Each file is a
    document, or with `jsonl` each line of it is one, a JSON object whose `jsonl` field holds the text (Megatron's
    --json-keys); `eod`: a token whose id follows every document (Megatron's --append-eod). ConfigError, with
    nothing left, for a file that cannot be read, is not UTF-8 or holds a line that is not such an object."""
    import shutil
    import tempfile

    from minigpt.data import TOKENS_FILE, TOKENS_FORMAT, TOKENS_HEADER, token_type

    directory = Path(directory)
    work = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        kind, sources, ender = token_type(tokenizer.vocab_size), [], eod_id(tokenizer, eod)
        with open(work / TOKENS_FILE, "wb") as stream:
            write = _Writer(stream, kind, ender)
            for path in paths:
                sources.append(_encode_jsonl(path, tokenizer, write, jsonl) if jsonl is not None
                               else _encode_file(path, tokenizer, write, piece_chars))
        tokenizer.save(work)
        header = {"format": TOKENS_FORMAT, "version": 1, "dtype": kind, "tokens": sum(s["tokens"] for s in sources),
                  "tokenizer": tokenizer.describe(), "sources": sources,
                  **({"eod": {"token": eod, "id": ender}} if eod is not None else {})}
        (work / TOKENS_HEADER).write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(work, 0o777 & ~mask)  # as a directory made plainly (mkdtemp's is the owner's alone)
        if directory.is_dir():
            directory.rmdir()  # new or empty, as the caller checked
        os.rename(work, directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return header


class _Writer:
    """Ids appended to a token stream (little-endian `kind`), and `eod` (None: nothing) where a document ends; counts
    what it wrote."""

    def __init__(self, stream, kind: str, eod: int | None):
        import numpy as np

        self.stream, self.dtype, self.eod, self.count = stream, np.dtype(kind).newbyteorder("<"), eod, 0

    def ids(self, values) -> None:
        import numpy as np

        values = np.asarray(values, dtype=self.dtype)
        self.stream.write(values.tobytes())
        self.count += len(values)

    def end_document(self) -> None:
        if self.eod is not None:
            self.ids([self.eod])


def _encode_file(path: str, tokenizer, write: _Writer, piece_chars: int) -> dict:
    """Append the ids of the text file `path` (one document) to the stream, piece by piece; its source entry."""
    digest, size, first = hashlib.sha256(), 0, write.count
    for piece, raw in _pieces(path, tokenizer, piece_chars):
        digest.update(raw)
        size += len(raw)
        write.ids(tokenizer.encode(piece).numpy())
    write.end_document()
    return {"path": str(path), "bytes": size, "tokens": write.count - first, "documents": 1,
            "sha256": digest.hexdigest()}


def _encode_jsonl(path: str, tokenizer, write: _Writer, key: str) -> dict:
    """Append the ids of every document of the JSON Lines file `path` (each line an object whose `key` holds a text;
    blank lines skipped) to the stream; its source entry. ConfigError naming the first line that is not one."""
    digest, size, first, documents = hashlib.sha256(), 0, write.count, 0
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                digest.update(raw)
                size += len(raw)
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw).get(key)
                except (ValueError, AttributeError, RecursionError):
                    text = None
                if not isinstance(text, str):
                    raise ConfigError(f"{path}:{number} is not a JSON object with a text under {key!r} (--jsonl "
                                      f"{key}: one document per line)")
                write.ids(tokenizer.encode(text).numpy())
                write.end_document()
                documents += 1
    except OSError as error:
        raise ConfigError(f"cannot read data file {str(path)!r}: {error.strerror or error}") from None
    return {"path": str(path), "bytes": size, "tokens": write.count - first, "documents": documents,
            "sha256": digest.hexdigest()}


def _pieces(path: str, tokenizer, piece_chars: int):
    """(text, its bytes) of `path` in pieces of about `piece_chars` characters, cut where encoding them apart gives
    the whole text's ids (any character boundary for bytes); ConfigError for a file unreadable or not UTF-8."""
    import codecs

    decoder, text, read = codecs.getincrementaldecoder("utf-8")(), "", 0
    anywhere = is_bytes(tokenizer)  # the byte tokenizer's ids are each character's bytes: any cut holds
    try:
        with open(path, "rb") as handle:
            while True:
                block = handle.read(READ_BYTES)
                start = read - len(decoder.getstate()[0])  # where the decoder's input starts: a character's bytes
                text += decoder.decode(block, final=not block)  # held back from the last block, then this one
                read += len(block)
                while len(text) >= piece_chars + CUT_CONTEXT or (not block and text):
                    cut = len(text) if not block else _cut(text, tokenizer, piece_chars, anywhere)
                    if cut is None:
                        break  # no line start to cut at yet: read on
                    yield text[:cut], text[:cut].encode("utf-8")
                    text = text[cut:]
                if not block:
                    return
    except UnicodeDecodeError as error:
        raise ConfigError(f"data file {str(path)!r} is not UTF-8 text (byte {start + error.start})") from None
    except OSError as error:
        raise ConfigError(f"cannot read data file {str(path)!r}: {error.strerror or error}") from None


def _cut(text: str, tokenizer, piece_chars: int, anywhere: bool) -> int | None:
    """Where to end a piece of `text`: at piece_chars where any cut holds (`anywhere`), else at the first line start
    past it whose context `tokenizer` encodes as its two sides; None where there is none yet."""
    if anywhere:
        return piece_chars
    cut = text.find("\n", piece_chars) + 1
    while 0 < cut <= len(text) - CUT_CONTEXT:
        left, right = text[cut - CUT_CONTEXT:cut], text[cut:cut + CUT_CONTEXT]
        apart = tokenizer.encode(left).tolist() + tokenizer.encode(right).tolist()
        if tokenizer.encode(left + right).tolist() == apart:
            return cut
        cut = text.find("\n", cut) + 1
    return None
