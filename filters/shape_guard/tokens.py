"""Counting text tokens the way the model will: whitespace words, or an HF ``tokenizer.json``.

Used by the shape guard to see that a BYTES text input is longer than a text encoder reads
(open_clip and HF's CLIPTokenizer cut at 77 tokens without a warning).
"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.errors import ErrorKind, ProxyError


class TextTokenizer(Protocol):
    def count(self, text: str) -> int: ...

    def counts(self, texts: list[str]) -> list[int]: ...

    def truncate(self, text: str, limit: int) -> str: ...


class WhitespaceTokenizer:
    def count(self, text: str) -> int:
        return len(text.split())

    def counts(self, texts: list[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def truncate(self, text: str, limit: int) -> str:
        return " ".join(text.split()[:limit])


class HfTokenizer:
    """A ``tokenizers`` JSON file; special tokens the post-processor adds are counted too."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ProxyError(ErrorKind.UNAVAILABLE, "shape_guard: a tokenizer.json needs the "
                             "'tokenizers' package (pip install tokenizers)") from None
        self._tok: Any = Tokenizer.from_file(path)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)

    def counts(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts)]  # batched in Rust

    def truncate(self, text: str, limit: int) -> str:
        enc = self._tok.encode(text)
        spans = [o for o in enc.offsets[:limit] if o != (0, 0)]  # special tokens have no span
        return text[: spans[-1][1]] if spans else ""


def load_tokenizer(spec: str) -> TextTokenizer:
    return WhitespaceTokenizer() if spec == "whitespace" else HfTokenizer(spec)
