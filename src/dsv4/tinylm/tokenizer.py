"""A character-level tokenizer: the tiny model's task needs digits, letters and a few symbols,
and one id per character keeps the answer digits one token each."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
DEFAULT_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz =;+-*.,?!"


class TokenizerError(ValueError):
    """Text holds a character the vocabulary does not have, or an id is out of range."""


class CharTokenizer:
    """ids 0..2 are ``<pad>``, ``<bos>``, ``<eos>``; then one id per character of ``chars``."""

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise TokenizerError(f"tokenizer characters must be unique, got {chars!r}")
        self.chars = chars
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self) -> int:
        return len(SPECIALS) + len(self.chars)

    @property
    def vocab_size(self) -> int:
        return len(self)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text`` (optionally framed by ``<bos>`` / ``<eos>``); unknown characters are an
        error that names them, never silently dropped."""
        bad = sorted({c for c in text if c not in self._to_id})
        if bad:
            raise TokenizerError(f"characters {bad} are not in the tokenizer's vocabulary "
                                 f"{self.chars!r}")
        ids = [self._to_id[c] for c in text]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> str:
        """Text of ``ids``: specials are dropped, decoding stops at ``<eos>`` (by default)."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self):
                raise TokenizerError(f"token id {i} is outside the vocabulary (size {len(self)})")
            if i == self.eos_id and stop_at_eos:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def to_dict(self) -> dict[str, str]:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict[str, str] | None) -> CharTokenizer:
        if d is None:
            return cls()
        if d.get("type", "char") != "char" or not isinstance(d.get("chars"), str):
            raise TokenizerError(f"tokenizer config {d!r}: expected {{'type': 'char', "
                                 "'chars': '...'}")
        return cls(d["chars"])

    def batch_encode(self, texts: Sequence[str], bos: bool = True) -> list[list[int]]:
        return [self.encode(t, bos=bos) for t in texts]
