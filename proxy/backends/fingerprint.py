"""What a version fuse fingerprints beyond a model's path: its tokenizer and its processor.

A canary that serves the same weights with another tokenizer answers differently while every
field the old fingerprint hashed (path, max_model_len, server version) stays the same. The
seeds' rule: compare a SHA-256 of each one's configuration. So:

- vLLM: ``/tokenizer_info`` (served with ``--enable-tokenizer-info-endpoint``; absent otherwise)
  and the token ids ``/tokenize`` gives for a fixed probe set — which changes whenever the
  vocabulary, the merges, the normaliser or the special tokens do, endpoint or not;
- Triton / ONNX Runtime: the model config and version (as before), plus the SHA-256 of the
  files the operator declares (``fingerprint_files``: tokenizer.json, preprocessor_config.json).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from proxy.contract import ModelContract, fingerprint

PROBES: tuple[str, ...] = (
    "Hello, world!",
    "A photo of two cats sleeping on a red sofa.",
    "mmguard probe 0123456789 ~!@#$%^&*()_+{}|:<>?",
    "tokenizer\nchange\tdetector  with   spaces",
    "Ünïcödé naïve café – 日本語 😀",
)
"""Texts whose token ids go into a vLLM fingerprint (fixed: changing them changes every
fingerprint)."""


def file_digests(paths: tuple[str, ...] | list[str]) -> dict[str, str]:
    """SHA-256 of each declared file (``missing`` when it is not there: a fingerprint, not a
    load check)."""
    out = {}
    for name in paths:
        p = Path(name)
        try:
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError:
            out[p.name] = "missing"
    return out


def tokenizer_part(info: dict[str, Any] | None,
                   probe_ids: list[list[int]] | None) -> dict[str, Any]:
    """The tokenizer's share of a vLLM fingerprint (its digest, and what went into it); None
    for what the server does not expose."""
    canonical = repr(sorted((info or {}).items()))
    return {"tokenizer_info_sha256": hashlib.sha256(canonical.encode()).hexdigest()
            if info is not None else None,
            "probe_ids_sha256": hashlib.sha256(repr(probe_ids).encode()).hexdigest()
            if probe_ids is not None else None}


def with_files(contract: ModelContract, files: tuple[str, ...]) -> ModelContract:
    """The contract with the declared files' SHA-256 in its fingerprint (its config is what
    clients may read: left as Triton sent it)."""
    if not files:
        return contract
    return replace(contract, fingerprint=fingerprint(contract.fingerprint,
                                                     file_digests(list(files))))
