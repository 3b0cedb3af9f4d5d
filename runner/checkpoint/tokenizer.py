"""The small byte-level tokenizer that ships with mixfleet (no downloads).

Ids 0..15 are special tokens, ids 16..271 are the 256 bytes, so any text round-trips exactly
(`decode(encode(s)) == s`). Special tokens appear in text as their `<|name|>` strings and are
recognized by `encode`. The tokenizer is saved beside the weights (`tokenizer.json`) so a sampler
and a trainer loading the same checkpoint agree on every id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",        # 0
    "<|bos|>",        # 1
    "<|eos|>",        # 2  end of a reply; the default stop token
    "<|system|>",     # 3
    "<|user|>",       # 4
    "<|assistant|>",  # 5
    "<|tool|>",       # 6  a tool's output follows
    "<|call|>",       # 7  a tool call starts
    "<|endcall|>",    # 8  a tool call ends
    "<|reserved_9|>",
    "<|reserved_10|>",
    "<|reserved_11|>",
    "<|reserved_12|>",
    "<|reserved_13|>",
    "<|reserved_14|>",
    "<|reserved_15|>",
)
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256
TOKENIZER_FILE = "tokenizer.json"

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer with 16 special tokens; `vocab_size` = 272."""

    name: str = "mixfleet-byte-v1"

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def pad_id(self) -> int:
        return SPECIAL_TOKENS.index("<|pad|>")

    @property
    def bos_id(self) -> int:
        return SPECIAL_TOKENS.index("<|bos|>")

    @property
    def eos_id(self) -> int:
        return SPECIAL_TOKENS.index("<|eos|>")

    def token_id(self, special: str) -> int:
        """Id of a special token given as `<|name|>` (ValueError listing the known ones otherwise)."""
        try:
            return SPECIAL_TOKENS.index(special)
        except ValueError:
            raise ValueError(f"unknown special token {special!r}; known: {', '.join(SPECIAL_TOKENS)}") from None

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < BYTE_OFFSET

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Text to ids; `<|name|>` strings become their special ids, everything else UTF-8 bytes."""
        ids: list[int] = [self.bos_id] if add_bos else []
        for piece in _SPECIAL_RE.split(text):
            if not piece:
                continue
            if piece in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS.index(piece))
            else:
                ids.extend(b + BYTE_OFFSET for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Ids to text. Invalid UTF-8 sequences (a reply cut mid-character) decode with U+FFFD."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} outside the vocabulary [0, {VOCAB_SIZE})")
            if i >= BYTE_OFFSET:
                buf.append(i - BYTE_OFFSET)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if not skip_special_tokens:
                out.append(SPECIAL_TOKENS[i])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` into `directory` (created if needed); returns its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = {"type": "byte", "name": self.name, "byte_offset": BYTE_OFFSET,
                "special_tokens": list(SPECIAL_TOKENS), "vocab_size": VOCAB_SIZE}
        path.write_text(json.dumps(spec, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        """Read `tokenizer.json` from a checkpoint folder; refuses a file of another tokenizer."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
        spec = json.loads(path.read_text())
        if spec.get("type") != "byte" or spec.get("special_tokens") != list(SPECIAL_TOKENS):
            raise ValueError(f"{path}: not a mixfleet byte tokenizer (type={spec.get('type')!r})")
        return cls(name=spec.get("name", cls.name))


def render_ids(tok: ByteTokenizer, ids: Sequence[int]) -> str:
    """Debug view of ids with special tokens shown (for logs and error messages)."""
    return tok.decode(ids, skip_special_tokens=False)
