"""``shape_guard``: no request is ever silently truncated, padded or cut.

Guards against a backend that accepts what it cannot really serve and answers anyway: ONNX
Runtime and Triton accept any size on a -1 / symbolic dimension, CLIP-style text encoders cut text
at 77 tokens without a word, vLLM cuts the answer to fit its context (``finish_reason:
"length"``), a batch above ``max_batch_size`` is cut. Seed scenario: a vision encoder emits
[1,256,1024] into a decoder that reads [1,196,1024] and the tail tokens vanish.

The guard checks every request against the backend's contract (plus what config declares that
the backend hides: a real dim, a token limit and how to count it) before the backend sees it, and
every answer against the contract after. Each violation has a policy: ``reject`` (default: a 400
that names the input, the limit, what came and what would be lost), ``split`` (batch), ``truncate``
(tokens; announced), ``reroute`` (to another route whose contract fits).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from filters.shape_guard.tokens import TextTokenizer, load_tokenizer
from proxy.call import Api, Call, LocalReply, Reply, Result, SseEvent
from proxy.chain import FilterContext, Next
from proxy.contract import ModelContract, TensorSpec
from proxy.errors import ErrorKind, ProxyError
from proxy.lifecycle import ConfigReferences, FilterFactoryBase
from proxy.strict import Strict
from proxy.tensor import Tensor, decode_bytes_elements, encode_bytes_elements
from proxy.wire.openai import ChatView


class InputDeclaration(Strict):
    dims: tuple[int, ...] | None = None
    """The real dims the model applies where the contract says -1 (e.g. [-1, 3, 224, 224])."""
    max_tokens: int | None = Field(None, gt=0)
    """Tokens the model really reads (CLIP's text encoder: 77)."""
    pad_token_id: int | None = None
    """For token-id inputs: the id that pads; non-pad ids past max_tokens would be dropped."""
    tokenizer: str | None = None
    """For BYTES text inputs: 'whitespace' or the path of a tokenizer.json (HF tokenizers)."""


class ShapeGuardConfig(Strict):
    inputs: dict[str, InputDeclaration] = Field(default_factory=dict)
    on_batch: Literal["reject", "split"] = "reject"
    """A batch above max_batch_size: refuse, or cut it into chunks and merge the answers."""
    on_tokens: Literal["reject", "truncate", "reroute"] = "reject"
    """Text longer than the declared token limit."""
    on_context: Literal["reject", "reroute"] = "reject"
    """OpenAI: prompt tokens + max_tokens over the model's max_model_len."""
    reroute_to: str | None = None
    """The route (model name) to send to when a reroute policy applies; its contract must fit."""
    split_concurrency: int = Field(4, ge=1)
    check_outputs: bool = True
    """Check answers against the contract (batch, dims, datatype, byte length)."""
    on_length_finish: Literal["report", "reject"] = "report"
    """vLLM finish_reason "length": report it (header, metric), or refuse the answer (422)."""

    @model_validator(mode="after")
    def _reroute_needs_target(self) -> ShapeGuardConfig:
        if "reroute" in (self.on_tokens, self.on_context) and not self.reroute_to:
            raise ValueError("a 'reroute' policy needs reroute_to (the route to send to)")
        for name, decl in self.inputs.items():
            if decl.tokenizer and decl.max_tokens is None:
                raise ValueError(f"inputs.{name}: a tokenizer needs max_tokens")
            if decl.pad_token_id is not None and decl.max_tokens is None:
                raise ValueError(f"inputs.{name}: pad_token_id needs max_tokens")
        return self

    def references(self) -> ConfigReferences:
        """The reroute route and the tokenizer files (checked at load)."""
        return ConfigReferences(
            routes=(("reroute_to", self.reroute_to),) if self.reroute_to else (),
            files=tuple((f"inputs.{name}.tokenizer", Path(d.tokenizer))
                        for name, d in self.inputs.items()
                        if d.tokenizer and d.tokenizer != "whitespace"))


@dataclass
class Violation:
    check: str  # unknown-input, missing-input, datatype, rank, dims, batch, batch-agree, tokens,
    #             context, output
    message: str
    input: str = ""


class ShapeGuard:
    def __init__(self, cfg: ShapeGuardConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.tokenizers: dict[str, TextTokenizer] = {
            name: load_tokenizer(d.tokenizer) for name, d in cfg.inputs.items() if d.tokenizer}

    def _decide(self, call: Call, check: str, policy: str, detail: str) -> None:
        # Header mmguard-shape-<check>: <policy>; <detail>. Metric decision label check:policy.
        self.ctx.telemetry.decide(call, "shape", policy, detail, header=check, check=check,
                                  policy=policy)

    def _reject(self, call: Call, found: list[Violation]) -> LocalReply:
        message = "; ".join(v.message for v in found)
        self._decide(call, found[0].check, "reject", message)
        return LocalReply(ErrorKind.INVALID_ARGUMENT, message)

    async def __call__(self, call: Call, next: Next) -> Reply:
        if call.api is Api.OPENAI:
            return await self._openai(call, next)
        contract = self.ctx.contract()
        if contract is None:
            self._decide(call, "contract", "unchecked", "the backend's contract is not known yet")
            return await next(call)
        found = self.check_request(call, contract)
        hard = [v for v in found if v.check not in ("batch", "tokens")]
        if hard:
            return self._reject(call, hard)
        tokens = [v for v in found if v.check == "tokens"]
        if tokens:
            if self.cfg.on_tokens == "reject":
                return self._reject(call, tokens)
            if self.cfg.on_tokens == "reroute":
                return await self._reroute(call, "tokens", tokens[0].message)
            self._truncate(call, tokens)
        batch = [v for v in found if v.check == "batch"]
        if batch:
            if self.cfg.on_batch == "reject":
                return self._reject(call, batch)
            self._decide(call, "batch", "split", batch[0].message)
            result = await self._split(call, next, contract.max_batch_size)
        else:
            result = await next(call)
        if isinstance(result, Result) and self.cfg.check_outputs and result.stream is None:
            return self._check_outputs(call, result, contract)
        return result

    # --- request checks ---------------------------------------------------------------------

    def check_request(self, call: Call, contract: ModelContract) -> list[Violation]:
        found: list[Violation] = []
        model = contract.name
        names = {t.name for t in call.inputs}
        for t in call.inputs:
            spec = contract.input(t.name)
            if spec is None:
                found.append(Violation("unknown-input", f"model '{model}' has no input "
                                       f"'{t.name}' (inputs: {[s.name for s in contract.inputs]})",
                                       t.name))
                continue
            found.extend(self._check_tensor(t, spec, contract, "input"))
        for spec in contract.inputs:
            if spec.name not in names and not spec.optional:
                found.append(Violation("missing-input", f"model '{model}' needs input "
                                       f"'{spec.name}' ({spec.datatype} {list(spec.dims)})",
                                       spec.name))
        if contract.max_batch_size > 0:
            batches = {t.name: t.shape[0] for t in call.inputs if t.shape}
            if len(set(batches.values())) > 1:
                found.append(Violation("batch-agree", f"inputs disagree on the batch size: "
                                       f"{batches}"))
            elif batches:
                n = next(iter(batches.values()))
                if n > contract.max_batch_size:
                    found.append(Violation("batch", f"batch of {n} is larger than model "
                                           f"'{model}' takes (max_batch_size "
                                           f"{contract.max_batch_size})"))
        for t in call.inputs:
            decl = self.cfg.inputs.get(t.name)
            if decl is not None and decl.max_tokens is not None:
                found.extend(self._check_tokens(t, decl, model))
        return found

    def _check_tensor(self, t: Tensor, spec: TensorSpec, contract: ModelContract,
                      role: str) -> list[Violation]:
        if t.datatype != spec.datatype:
            return [Violation("datatype", f"{role} '{t.name}' is {t.datatype}; model "
                              f"'{contract.name}' expects {spec.datatype}", t.name)]
        decl = self.cfg.inputs.get(t.name) if role == "input" else None
        dims = decl.dims if decl is not None and decl.dims is not None else spec.dims
        where = f"{role} '{t.name}'"  # (after the datatype: most tensors pass it)
        if len(t.shape) != len(dims):
            return [Violation("rank", f"{where} has shape {list(t.shape)} (rank {len(t.shape)}); "
                              f"model '{contract.name}' expects {list(dims)} (rank {len(dims)})",
                              t.name)]
        batched = contract.max_batch_size > 0
        for i, (got, want) in enumerate(zip(t.shape, dims, strict=True)):
            if want >= 0 and got != want and not (batched and i == 0):
                verb = "cut" if got > want else "padded"
                return [Violation("dims", f"{where} has shape {list(t.shape)}; model "
                                  f"'{contract.name}' expects {list(dims)} (dim {i} is {got}, "
                                  f"not {want}: it would be {verb} or refused)", t.name)]
        return []

    def _check_tokens(self, t: Tensor, decl: InputDeclaration, model: str) -> list[Violation]:
        limit = decl.max_tokens
        assert limit is not None
        counts = self._token_counts(t, decl)
        worst = max(counts, default=0)
        if worst <= limit:
            return []
        row = counts.index(worst)
        return [Violation("tokens", f"input '{t.name}' has {worst} tokens (element {row}); model "
                          f"'{model}' reads {limit} and would silently drop {worst - limit}",
                          t.name)]

    def _token_counts(self, t: Tensor, decl: InputDeclaration) -> list[int]:
        if t.datatype == "BYTES":
            tok = self.tokenizers.get(t.name)
            if tok is None:
                raise ProxyError(ErrorKind.INTERNAL, f"shape_guard: input '{t.name}' is text; "
                                 "declare a tokenizer to count its tokens")
            return tok.counts([b.decode("utf-8", "replace") for b in t.numpy().reshape(-1)])
        ids = t.numpy()
        rows = ids.reshape(-1, ids.shape[-1]) if ids.ndim else ids.reshape(1, 1)
        if decl.pad_token_id is None:
            return [rows.shape[-1]] * rows.shape[0]
        # The position of the last non-pad token: everything up to it is read by the model.
        real = rows != decl.pad_token_id
        last = np.where(real.any(axis=1), rows.shape[-1] - np.argmax(real[:, ::-1], axis=1), 0)
        return [int(x) for x in last]

    def _truncate(self, call: Call, found: list[Violation]) -> None:
        inputs = list(call.inputs)
        for v in found:
            i = next(k for k, t in enumerate(inputs) if t.name == v.input)
            t, decl = inputs[i], self.cfg.inputs[v.input]
            assert decl.max_tokens is not None
            if t.datatype == "BYTES":
                tok = self.tokenizers[t.name]
                items = [tok.truncate(b.decode("utf-8", "replace"), decl.max_tokens).encode()
                         for b in t.numpy().reshape(-1)]
                inputs[i] = Tensor(t.name, "BYTES", t.shape, raw=encode_bytes_elements(items),
                                   parameters=t.parameters)
            else:
                arr = np.ascontiguousarray(t.numpy()[..., : decl.max_tokens])
                if decl.pad_token_id is not None and arr.shape[-1] < t.shape[-1]:
                    pad = np.full((*t.shape[:-1], t.shape[-1] - arr.shape[-1]),
                                  decl.pad_token_id, dtype=arr.dtype)
                    arr = np.concatenate([arr, pad], axis=-1)  # keep the shape, drop the tail
                inputs[i] = Tensor.from_numpy(t.name, arr, t.datatype)
            self._decide(call, "tokens", "truncate", v.message)
        call.set_inputs(inputs)

    async def _reroute(self, call: Call, check: str, message: str) -> Reply:
        """Hand the call to the reroute target's own chain: its guard checks its own contract
        and declarations, so a target that does not fit refuses with its own reason."""
        assert self.cfg.reroute_to is not None and self.ctx.reroute is not None
        self._decide(call, check, "reroute", f"{message}; sent to '{self.cfg.reroute_to}'")
        return await self.ctx.reroute(self.cfg.reroute_to, call)

    # --- split ------------------------------------------------------------------------------

    async def _split(self, call: Call, next: Next, size: int) -> Reply:
        batch = call.inputs[0].shape[0]
        bounds = [(lo, min(lo + size, batch)) for lo in range(0, batch, size)]
        gate = asyncio.Semaphore(self.cfg.split_concurrency)

        async def one(lo: int, hi: int) -> Reply:
            assert call.target is not None
            sub = replace(call, inputs=[_rows(t, lo, hi, batch) for t in call.inputs], wire=None,
                          target=replace(call.target), decisions={})
            async with gate:
                return await next(sub)

        replies = await asyncio.gather(*(one(lo, hi) for lo, hi in bounds))
        for r in replies:
            if isinstance(r, LocalReply):
                return r
        parts = [r for r in replies if isinstance(r, Result)]
        outputs = []
        for first in parts[0].outputs:
            pieces = [p.output(first.name) for p in parts]
            if any(p is None for p in pieces):
                return LocalReply(ErrorKind.INTERNAL, f"split: a chunk's answer has no output "
                                  f"'{first.name}'", origin="backend")
            outputs.append(_concat([p for p in pieces if p is not None], batch))
        return Result(call.model, parts[0].version, call.id, outputs)

    # --- answers ----------------------------------------------------------------------------

    def _check_outputs(self, call: Call, result: Result, contract: ModelContract) -> Reply:
        found = []
        batch = call.inputs[0].shape[0] if call.inputs and call.inputs[0].shape else None
        for t in result.outputs:
            spec = contract.output(t.name)
            if spec is None:
                found.append(Violation("output", f"output '{t.name}' is not in the contract"))
                continue
            found.extend(self._check_tensor(t, spec, contract, "output"))
            if contract.max_batch_size > 0 and t.shape and batch is not None \
                    and t.shape[0] != batch:
                found.append(Violation("output", f"output '{t.name}' has batch {t.shape[0]}; "
                                       f"the request had {batch}"))
            try:
                t.check_payload()
            except ProxyError as err:
                found.append(Violation("output", err.message.replace("input", "output", 1)))
        if found:
            message = "; ".join(v.message for v in found)
            self._decide(call, "output", "reject", message)
            return LocalReply(ErrorKind.BAD_GATEWAY, f"model '{contract.name}' answered outside "
                              f"its contract: {message}", origin="backend")
        return result

    # --- OpenAI -----------------------------------------------------------------------------

    async def _openai(self, call: Call, next: Next) -> Reply:
        contract = self.ctx.contract()
        limit = contract.context_length if contract is not None else None
        if limit is not None and self.ctx.count_tokens is not None:
            prompt = await self.ctx.count_tokens(call)
            wanted = ChatView(call).max_tokens or 0
            if prompt is not None and prompt + wanted > limit:
                message = (f"model '{call.model}' has max_model_len {limit}; the prompt has "
                           f"{prompt} tokens and max_tokens is {wanted}: "
                           + (f"the answer would be cut at {limit - prompt} tokens"
                              if prompt < limit else f"the prompt alone is {prompt - limit + 1} "
                              "tokens too long"))
                if self.cfg.on_context == "reject":
                    self._decide(call, "context", "reject", message)
                    return LocalReply(ErrorKind.INVALID_ARGUMENT, message, param="max_tokens")
                return await self._reroute(call, "context", message)
        result = await next(call)
        if isinstance(result, Result):
            return self._watch_finish(call, result)
        return result

    def _watch_finish(self, call: Call, result: Result) -> Reply:
        if result.stream is not None:
            result.stream = self._watch_stream(call, result.stream)
            return result
        if result.wire is None:
            return result
        try:
            doc = json.loads(result.wire.body)
        except ValueError:
            return result
        if any(isinstance(c, dict) and c.get("finish_reason") == "length"
               for c in doc.get("choices") or []):
            detail = "the answer was cut at max_tokens or at the context limit"
            if self.cfg.on_length_finish == "reject":
                self._decide(call, "finish", "reject", detail)
                return LocalReply(ErrorKind.UNPROCESSABLE, f"model '{call.model}': {detail} "
                                  "(finish_reason length)")
            self._decide(call, "finish", "length", detail)
        return result

    async def _watch_stream(self, call: Call, stream: Any) -> Any:
        async for item in stream:
            if isinstance(item, SseEvent):
                doc = item.json()
                if doc and any(isinstance(c, dict) and c.get("finish_reason") == "length"
                               for c in doc.get("choices") or []):
                    # Headers are gone by now: the decision is a metric, span event and log.
                    self._decide(call, "finish", "length", "stream cut (finish_reason length)")
            yield item


def _rows(t: Tensor, lo: int, hi: int, batch: int) -> Tensor:
    """Rows lo..hi of a batched tensor, without copying fixed-size payloads."""
    shape = (hi - lo, *t.shape[1:])
    if t.datatype == "BYTES":
        per_row = t.elements // batch
        items = decode_bytes_elements(t.raw_bytes(), t.elements, t.name)
        return Tensor(t.name, "BYTES", shape, raw=encode_bytes_elements(
            items[lo * per_row: hi * per_row]), parameters=t.parameters)
    row = t.nbytes // batch
    return Tensor(t.name, t.datatype, shape, raw=memoryview(t.raw_bytes())[lo * row: hi * row],
                  parameters=t.parameters)


def _concat(pieces: list[Tensor], batch: int) -> Tensor:
    first = pieces[0]
    raw = b"".join(bytes(p.raw_bytes()) for p in pieces)
    return Tensor(first.name, first.datatype, (batch, *first.shape[1:]), raw=raw)


class ShapeGuardFactory(FilterFactoryBase):
    name = "shape_guard"
    config_model = ShapeGuardConfig

    def build(self, config: ShapeGuardConfig, ctx: FilterContext) -> ShapeGuard:
        return ShapeGuard(config, ctx)
