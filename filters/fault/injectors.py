"""What each action does to a call or an answer: seeded perturbations of inputs and outputs."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from filters import perturb
from filters.fault.config import (
    FLOAT_TYPES,
    INT_TYPES,
    Degrade,
    DropModality,
    Gradient,
    InputAction,
    Noise,
    OutputFault,
    PatchMask,
    Precision,
    TextCorrupt,
    TokenDropout,
)
from proxy.call import Api, Call, Result, SseEvent
from proxy.tensor import Tensor, decode_bytes_elements, encode_bytes_elements


def _is_image(t: Tensor) -> bool:
    return t.datatype in FLOAT_TYPES and len(t.shape) >= 3


def _targets(call: Call, a: InputAction, pick: Callable[[Tensor], bool]) -> list[Tensor]:
    if a.inputs:
        return [t for t in call.inputs if t.name in a.inputs]
    return [t for t in call.inputs if pick(t)]


def _image_op(a: InputAction, rng: np.random.Generator) -> Callable[[NDArray[Any]], NDArray[Any]]:
    if isinstance(a, Noise):
        if a.kind == "gaussian_noise":
            return lambda x: perturb.gaussian_noise(x, a.sigma, rng, a.lo, a.hi)
        return lambda x: perturb.sign_noise(x, a.eps, rng, a.lo, a.hi)
    if isinstance(a, Gradient):
        surrogate = _surrogate(str(a.surrogate), a.mode, a.device)
        steps = a.steps or (1 if a.kind == "fgsm" else 5)
        return lambda x: perturb.fgsm(x, a.eps, surrogate, steps=steps, lo=a.lo, hi=a.hi)
    if isinstance(a, PatchMask):
        return lambda x: perturb.patch_mask(x, a.ratio, a.patch, rng)[0]
    if isinstance(a, Precision):
        return lambda x: perturb.precision_collapse(x, a.mode, a.decimals)
    if isinstance(a, Degrade):
        if a.kind == "blur":
            return lambda x: perturb.blur(x, a.radius)
        if a.kind == "darken":
            return lambda x: perturb.darken(x, a.factor)
        return lambda x: perturb.quantise(x, a.levels)
    raise ValueError(f"{a.label} is not an image perturbation")


_SURROGATES: dict[tuple[str, str, str], Any] = {}


def _surrogate(path: str, mode: Literal["lower", "raise"], device: str) -> Any:
    found = _SURROGATES.get((path, mode, device))
    if found is None:
        found = _SURROGATES[(path, mode, device)] = perturb.load_surrogate(path, mode=mode,
                                                                           device=device)
    return found


def _perturb_tensors(call: Call, a: InputAction, seed: int) -> str:
    rng = np.random.default_rng(seed)
    if isinstance(a, DropModality):
        names = set(a.inputs)
        kept = [t for t in call.inputs if t.name not in names]
        if len(kept) == len(call.inputs):
            return ""
        call.set_inputs(kept)
        return f"dropped {sorted(names & {t.name for t in call.inputs} or names)}"
    out = list(call.inputs)
    touched: list[str] = []
    if isinstance(a, PatchMask) and a.tokens:
        images = _targets(call, a, _is_image)
        ids = call.input(a.tokens)
        if images and ids is not None:
            img, tok = perturb.shared_mask(seed, images[0].numpy(), ids.numpy(), a.ratio,
                                           a.patch, pad_id=a.pad_id)
            _replace(out, images[0], img)
            _replace(out, ids, tok)
            call.set_inputs(out)
            return (f"patch mask {a.ratio:g} on '{images[0].name}' and '{ids.name}' "
                    f"(patch {a.patch}, one seed)")
    if isinstance(a, TokenDropout):  # token ids lose tokens; text loses words
        for t in _targets(call, a, lambda t: t.datatype in (*INT_TYPES, "BYTES")):
            if t.datatype in INT_TYPES:
                _replace(out, t, perturb.token_dropout(t.numpy(), a.p, rng, pad_id=a.pad_id,
                                                       keep_first=a.keep_first))
            elif t.datatype == "BYTES":
                texts = [x.decode("utf-8", "replace") for x in _bytes_items(t)]
                _replace_bytes(out, t, [perturb.word_dropout(x, a.p, rng) for x in texts])
            else:
                continue
            touched.append(t.name)
    elif isinstance(a, TextCorrupt):
        for t in _targets(call, a, lambda t: t.datatype == "BYTES"):
            texts = [x.decode("utf-8", "replace") for x in _bytes_items(t)]
            _replace_bytes(out, t, [_corrupt_text(x, a, rng) for x in texts])
            touched.append(t.name)
    else:
        pick = (lambda t: t.datatype in FLOAT_TYPES) if isinstance(a, Precision) else _is_image
        op = _image_op(a, rng)
        for t in _targets(call, a, pick):
            if t.datatype not in FLOAT_TYPES:
                continue
            _replace(out, t, op(t.numpy()))
            touched.append(t.name)
    if not touched:
        return ""
    call.set_inputs(out)
    return f"{a.what} on {touched}"


def _corrupt_text(text: str, a: TextCorrupt, rng: np.random.Generator) -> str:
    if a.kind == "mixed_scripts":
        return str(perturb.mixed_scripts(text, a.share, rng))
    return str(perturb.cut_text(text, a.keep))


def _bytes_items(t: Tensor) -> list[bytes]:
    return decode_bytes_elements(t.raw_bytes(), t.elements, t.name)


def _replace(out: list[Tensor], old: Tensor, arr: NDArray[Any]) -> None:
    i = next(j for j, t in enumerate(out) if t.name == old.name)
    out[i] = Tensor.from_numpy(old.name, np.ascontiguousarray(arr).astype(arr.dtype),
                               old.datatype)


def _replace_bytes(out: list[Tensor], old: Tensor, texts: list[str]) -> None:
    i = next(j for j, t in enumerate(out) if t.name == old.name)
    out[i] = Tensor(old.name, "BYTES", old.shape,
                    raw=encode_bytes_elements([x.encode() for x in texts]))


def _perturb_openai(call: Call, a: InputAction, seed: int) -> str:
    from proxy.wire.openai import ChatView
    view = ChatView(call)
    rng = np.random.default_rng(seed)
    if isinstance(a, DropModality):
        if a.modality == "image":
            images = view.images()
            for image in reversed(images):
                view.drop_image(image)
            return f"dropped {len(images)} image(s)" if images else ""
        return ""
    if isinstance(a, (TokenDropout, TextCorrupt)):
        texts = view.texts()
        for i, text in enumerate(texts):
            new = (perturb.word_dropout(text, a.p, rng) if isinstance(a, TokenDropout)
                   else _corrupt_text(text, a, rng))
            view.replace_text(i, new)
        return f"{a.what} on {len(texts)} text(s)" if texts else ""
    op = _image_op(a, rng)
    count = 0
    for image in view.images():
        if not image.url.startswith("data:"):
            continue
        pixels = image.array().astype(np.float32).transpose(2, 0, 1)[None] / 255.0
        changed = op(pixels)
        part = view.doc["messages"][image.message]["content"][image.part]
        part["image_url"] = {"url": _png_data_url(changed[0])}
        count += 1
    if count:
        call.wire = None
    return f"{a.what} on {count} image(s)" if count else ""


def _png_data_url(chw: NDArray[Any]) -> str:
    from PIL import Image
    hwc = (np.clip(chw.transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# --- outputs --------------------------------------------------------------------------------


def _corrupt_output(reply: Result, a: OutputFault) -> str:
    if reply.wire is not None and reply.wire.api is Api.OPENAI:
        return _corrupt_openai_answer(reply, a)
    outs = list(reply.outputs)
    touched = []
    for j, t in enumerate(outs):
        if a.outputs and t.name not in a.outputs:
            continue
        if a.kind == "nan_output":
            if t.datatype not in FLOAT_TYPES:
                continue
            arr = np.array(t.numpy(), copy=True)
            flat = arr.reshape(-1)
            count = max(1, math.ceil(flat.size * a.share)) if flat.size else 0
            flat[:count] = np.nan
            outs[j] = Tensor.from_numpy(t.name, arr, t.datatype)
        else:
            raw = bytes(t.raw_bytes())
            outs[j] = Tensor(t.name, t.datatype, t.shape, raw=raw[:int(len(raw) * a.keep)])
        touched.append(t.name)
    if not touched:
        return ""
    reply.set_outputs(outs)
    return f"{a.what} on {touched}"


def _corrupt_openai_answer(reply: Result, a: OutputFault) -> str:
    import json

    from proxy.call import Wire
    assert reply.wire is not None
    doc = json.loads(reply.wire.body)
    touched = 0
    for choice in doc.get("choices") or []:
        msg = choice.get("message") if isinstance(choice, dict) else None
        key, holder = (("content", msg) if isinstance(msg, dict) else ("text", choice))
        text = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(text, str):
            holder[key] = text[:int(len(text) * a.keep)] if a.kind == "truncate_output" else ""
            touched += 1
    if not touched:
        return ""
    reply.wire = Wire("openai", json.dumps(doc).encode(), content_type="application/json")
    return f"{a.kind} on {touched} choice(s)"


async def _corrupt_stream(items: AsyncIterator[Any], a: OutputFault) -> AsyncIterator[Any]:
    """truncate_output on a stream: text after ``after_events`` content events is dropped while
    the stream still ends normally (finish reason, usage, [DONE]) — a silently cut answer.
    nan_output has no meaning for text: it passes the stream unchanged."""
    import json
    n = 0
    async for item in items:
        if a.kind == "truncate_output" and isinstance(item, SseEvent) and not item.done:
            doc = item.json()
            if doc is not None:
                for choice in doc.get("choices") or []:
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict) and delta.get("content"):
                        n += 1
                        if n > a.after_events:
                            delta["content"] = ""
                if n > a.after_events:
                    item = SseEvent(b"data: " + json.dumps(doc).encode() + b"\n\n")
        yield item


