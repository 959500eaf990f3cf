"""Image–text alignment: does the image have anything to do with its text?

Guards against the cross-modal failure the seeds measure with CLIP scores (mean cosine 0.821 →
0.537 under load; gray release only above 0.85 alignment): an image paired with an unrelated
caption or question, which a vision-language model answers anyway. The user gives their own
CLIP-style pair as two ONNX files (an image encoder and a text encoder, each with one input and
its embedding as the first output); both run in-process on ONNX Runtime, loaded once per file
and shared by every route and reload that names it.

What the encoders read:

- v2 requests: the route's image input is fed to the image encoder as the client sent it (same
  layout, size and scaling — the usual case when the encoder is the model's own vision tower);
  the text input is fed as token ids when it is an integer tensor, or tokenized when it is BYTES.
- OpenAI requests: each decoded image is resized to the encoder's input size and scaled with
  ``image_mean`` / ``image_std``; the request's texts, joined, are tokenized.
- A text encoder with a string input gets the texts as they are; one with an integer input needs
  ``tokenizer`` (a ``tokenizers`` JSON file) unless the request already carries ids.

The cosine of each image–text pair is mapped to [0, 1] through ``cosine_range`` (raw CLIP
cosines of matching pairs sit near 0.3, so a real CLIP export wants something like [0.1, 0.35]).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, FilePath, model_validator

from proxy.errors import ErrorKind, ProxyError
from proxy.strict import Strict

F32 = NDArray[np.float32]


class AlignmentConfig(Strict):
    image_encoder: FilePath
    """ONNX image encoder: one image input (N, C, H, W), embeddings (N, D) as first output."""
    text_encoder: FilePath
    """ONNX text encoder: token ids (N, L) or strings (N,), embeddings (N, D) as first output."""
    image_input: str | None = None
    """v2: the request input fed to the image encoder (default: the only configured image)."""
    text_input: str | None = None
    """v2: the request input fed to the text encoder (token ids, or BYTES text)."""
    tokenizer: FilePath | None = None
    """A ``tokenizers`` JSON file, for texts when the text encoder reads token ids."""
    max_tokens: int = Field(77, gt=0)
    """Token ids per text (cut or padded), when the encoder's own length is not fixed."""
    pad_token_id: int = 0
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """OpenAI images: pixels in [0,1] become (x - mean) / std for the image encoder."""
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    cosine_range: tuple[float, float] = (0.0, 1.0)
    """Cosine mapped to the score: the first value scores 0, the second 1."""
    sample: float = Field(1.0, ge=0.0, le=1.0)
    """Share of scored requests that also get the (more expensive) alignment."""
    threads: int = Field(1, ge=1)
    """ONNX Runtime intra-op threads per encoder."""

    @model_validator(mode="after")
    def _check(self) -> AlignmentConfig:
        if self.cosine_range[0] >= self.cosine_range[1]:
            raise ValueError("cosine_range must be [low, high] with low < high")
        if any(s <= 0 for s in self.image_std):
            raise ValueError("image_std must be > 0")
        return self


class AlignmentUnavailable(Exception):
    """The pair cannot be scored for this request (why is the message); never a crash."""


_SESSIONS: dict[tuple[str, int, int, int], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def load_session(path: Path, threads: int) -> Any:
    """One ONNX Runtime session per (file version, threads), shared across routes and reloads."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ProxyError(ErrorKind.UNAVAILABLE, "quality: alignment runs its encoders on ONNX "
                         "Runtime (pip install 'mmguard[cpu]')") from None

    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, threads)
    with _SESSIONS_LOCK:
        found = _SESSIONS.get(key)
        if found is None:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            found = _SESSIONS[key] = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        return found


class EncoderPair:
    def __init__(self, cfg: AlignmentConfig) -> None:
        self.cfg = cfg
        self.image = load_session(cfg.image_encoder, cfg.threads)
        self.text = load_session(cfg.text_encoder, cfg.threads)
        self._image_in = self.image.get_inputs()[0]
        self._text_in = self.text.get_inputs()[0]
        dims = list(self._image_in.shape)
        fixed = [d if isinstance(d, int) and d > 0 else 224 for d in dims[-2:]]
        self.image_size = (fixed[0], fixed[1]) if len(fixed) == 2 else (224, 224)
        self.text_reads_strings = self._text_in.type == "tensor(string)"
        length = self._text_in.shape[-1] if len(self._text_in.shape) >= 2 else None
        self.text_length = length if isinstance(length, int) and length > 0 else cfg.max_tokens
        self._tokenizer: Any = None
        if cfg.tokenizer is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ProxyError(ErrorKind.UNAVAILABLE, "quality: alignment.tokenizer needs the "
                                 "'tokenizers' package (pip install tokenizers)") from None
            self._tokenizer = Tokenizer.from_file(str(cfg.tokenizer))

    # --- encoders ---------------------------------------------------------------------------

    def _run(self, session: Any, name: str, feed: NDArray[Any], what: str) -> F32:
        try:
            out = session.run(None, {name: feed})[0]
        except Exception as exc:  # ONNX Runtime's own error types; reported, never raised on
            raise AlignmentUnavailable(f"the {what} encoder refused the input: {exc}") from None
        emb = np.asarray(out, np.float32)
        return emb.reshape(emb.shape[0], -1)

    def embed_images(self, batch: NDArray[Any]) -> F32:
        """Images as the encoder reads them (N, C, H, W)."""
        want = np.float16 if self._image_in.type == "tensor(float16)" else np.float32
        return self._run(self.image, self._image_in.name, np.asarray(batch, want), "image")

    def prepare_rgb(self, rgb: NDArray[np.uint8]) -> F32:
        """An H × W × 3 uint8 picture as the encoder reads it: resized, scaled, (1, 3, H, W)."""
        from PIL import Image

        h, w = self.image_size
        img = Image.fromarray(np.ascontiguousarray(rgb[..., :3]))
        if img.size != (w, h):
            img = img.resize((w, h), Image.Resampling.BILINEAR)
        x = np.asarray(img, np.float32) / np.float32(255.0)
        x = (x - np.asarray(self.cfg.image_mean, np.float32)) / np.asarray(self.cfg.image_std,
                                                                            np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1)[None])

    def embed_ids(self, ids: NDArray[Any]) -> F32:
        if self.text_reads_strings:
            raise AlignmentUnavailable("the text encoder reads strings; the input holds ids")
        want = np.int32 if self._text_in.type == "tensor(int32)" else np.int64
        rows = np.asarray(ids).reshape(np.asarray(ids).shape[0], -1).astype(want, copy=False)
        return self._run(self.text, self._text_in.name, rows, "text")

    def embed_texts(self, texts: list[str]) -> F32:
        if self.text_reads_strings:
            feed = np.array(texts, dtype=object).reshape(-1, *([1] * (len(
                self._text_in.shape) - 1)))
            return self._run(self.text, self._text_in.name, feed, "text")
        if self._tokenizer is None:
            raise AlignmentUnavailable("the text encoder reads token ids and no tokenizer is "
                                       "configured (alignment.tokenizer)")
        ids = np.full((len(texts), self.text_length), self.cfg.pad_token_id, np.int64)
        for row, enc in enumerate(self._tokenizer.encode_batch(texts)):
            got = enc.ids[: self.text_length]
            ids[row, : len(got)] = got
        return self.embed_ids(ids)

    # --- scores -----------------------------------------------------------------------------

    def cosines(self, images: F32, texts: F32) -> F32:
        """Row-wise cosine; a single row on either side pairs with every row of the other."""
        if images.shape[0] != texts.shape[0] and 1 not in (images.shape[0], texts.shape[0]):
            raise AlignmentUnavailable(f"{images.shape[0]} images and {texts.shape[0]} texts "
                                       "cannot be paired")
        if images.shape[1] != texts.shape[1]:
            raise AlignmentUnavailable(f"the encoders disagree on the embedding size "
                                       f"({images.shape[1]} vs {texts.shape[1]})")
        a = images / np.maximum(np.linalg.norm(images, axis=1, keepdims=True), 1e-12)
        b = texts / np.maximum(np.linalg.norm(texts, axis=1, keepdims=True), 1e-12)
        return np.asarray(np.sum(a * b, axis=1), np.float32)

    def scores(self, cosines: F32) -> F32:
        lo, hi = self.cfg.cosine_range
        return np.clip((cosines - lo) / (hi - lo), 0.0, 1.0).astype(np.float32)
