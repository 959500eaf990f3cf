"""Applying a robustness experiment's perturbation to a copy of a call
(filters/robustness/experiment.py).

The same seed gives the same perturbation: production's copy and the canary's copy of one
request are perturbed identically. Copies are fresh (own state, own deadline) and not canary
traffic, so fault experiments never stack on them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from filters import perturb
from proxy.call import CANARY, Call, document_copy
from proxy.keys import Store
from proxy.tensor import Tensor

if TYPE_CHECKING:
    from filters.robustness.config import Perturbation

FLOAT_TYPES = ("FP16", "FP32", "FP64")
INT_TYPES = ("INT32", "INT64")


# --- perturbing a copy -------------------------------------------------------------------------


def seed_for(seed: int, label: str, key: str) -> int:
    digest = hashlib.blake2b(f"robustness:{seed}:{label}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def perturbed_copy(call: Call, p: Perturbation, seed: int, timeout_s: float) -> Call | None:
    """A fresh copy of ``call`` with ``p`` applied, not canary traffic; None when ``p`` has
    nothing to act on in this call (no image tensor for an image perturbation, and so on)."""
    now = time.monotonic()
    out = replace(call, inputs=list(call.inputs), headers=dict(call.headers),
                  document=document_copy(call.document) if call.document else None,
                  state=Store(), decisions={}, started=now, deadline=now + timeout_s)
    out.state[CANARY] = False  # faults must not stack on the perturbation
    rng = np.random.default_rng(seed)
    if out.document is not None:
        return out if _perturb_openai(out, p, rng) else None
    return out if _perturb_tensors(out, p, rng) else None


def clean_copy(call: Call, timeout_s: float) -> Call:
    """A fresh, unperturbed copy that fault experiments leave alone (a clean baseline)."""
    now = time.monotonic()
    out = replace(call, inputs=list(call.inputs), headers=dict(call.headers),
                  document=document_copy(call.document) if call.document else None,
                  state=Store(), decisions={}, started=now, deadline=now + timeout_s)
    out.state[CANARY] = False
    return out


def _image_op(p: Perturbation,
              rng: np.random.Generator) -> Callable[[NDArray[Any]], NDArray[Any]] | None:
    ops: dict[str, Callable[[NDArray[Any]], NDArray[Any]]] = {
        "gaussian_noise": lambda x: perturb.gaussian_noise(x, p.sigma, rng),
        "sign_noise": lambda x: perturb.sign_noise(x, p.eps, rng),
        "patch_mask": lambda x: perturb.patch_mask(x, p.ratio, p.patch, rng)[0],
        "occlusion": lambda x: perturb.occlude(x, p.area, rng)[0],
        "low_light": lambda x: perturb.gaussian_noise(perturb.darken(x, p.factor), p.noise, rng),
    }
    return ops.get(p.kind)


def _perturb_tensors(call: Call, p: Perturbation, rng: np.random.Generator) -> bool:
    if p.kind == "drop_modality":
        kept = [t for t in call.inputs if t.name not in set(p.inputs)]
        if not p.inputs or len(kept) == len(call.inputs):
            return False
        call.set_inputs(kept)
        return True
    chosen = [t for t in call.inputs if not p.inputs or t.name in p.inputs]
    out = list(call.inputs)
    touched = False
    for t in chosen:
        arr: NDArray[Any] | None = None
        if p.kind == "token_dropout" and t.datatype in INT_TYPES:
            arr = perturb.token_dropout(t.numpy(), p.p, rng, pad_id=p.pad_id)
        elif p.kind == "precision" and t.datatype in FLOAT_TYPES:
            arr = perturb.precision_collapse(t.numpy(), p.mode, p.decimals)
        elif t.datatype in FLOAT_TYPES and (p.inputs or len(t.shape) >= 3):
            op = _image_op(p, rng)
            arr = op(t.numpy()) if op is not None else None
        if arr is None:
            continue
        i = out.index(t)
        out[i] = Tensor.from_numpy(t.name, np.ascontiguousarray(arr), t.datatype)
        touched = True
    if touched:
        call.set_inputs(out)
    return touched


def _perturb_openai(call: Call, p: Perturbation, rng: np.random.Generator) -> bool:
    """OpenAI calls: text loses words (token_dropout) or the images go (drop_modality); image
    perturbations of ``data:`` URLs are the ``fault`` filter's business, not measured here."""
    from proxy.wire.openai import ChatView
    view = ChatView(call)
    if p.kind == "drop_modality":
        images = view.images()
        for image in reversed(images):
            view.drop_image(image)
        return bool(images)
    if p.kind == "token_dropout":
        texts = view.texts()
        for i, text in enumerate(texts):
            view.replace_text(i, perturb.word_dropout(text, p.p, rng))
        return bool(texts)
    return False
