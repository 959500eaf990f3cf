"""What the OpenAI front reads in an answer on its way to the client: the token usage and finish
reasons it counts, and the client's model name written into it on a route whose backend knows
the model by another name. A streamed event is parsed only to rename it, or when it may carry
usage or a finish reason (a JSON parse per event was the largest per-event cost of a stream)."""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.call import SseEvent
from proxy.telemetry import Telemetry

ACCOUNTED = re.compile(rb'"(?:usage|finish_reason)"\s*:\s*[{"]')
"""An event that may carry token usage or a finish reason (``null`` ones do not count)."""


class AnswerCounts:
    """``mmguard_tokens_total`` and ``mmguard_finish_reasons_total`` from the answers a front
    sends (their children looked up once: ``Telemetry.child``)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def events(self, model: str, raws: list[bytes], rename: bool) -> bytes:
        """Streamed events as the client gets them (renamed to ``model`` when ``rename``),
        their usage and finish reasons counted: one search over all of them first."""
        joined = raws[0] if len(raws) == 1 else b"".join(raws)
        if not rename and ACCOUNTED.search(joined) is None:
            return joined
        out = []
        for raw in raws:
            event = SseEvent(raw)
            doc = event.json() if rename or ACCOUNTED.search(raw) else None
            if doc is not None:
                self.count(model, doc)
            out.append(renamed_event(event, doc, model) if rename else raw)
        return b"".join(out)

    def count(self, model: str, doc: dict[str, Any] | None) -> None:
        """The usage and finish reasons of one answer (or streamed event)."""
        if not doc:
            return
        t = self.telemetry
        response = doc.get("response")
        usage = doc.get("usage") or (response.get("usage") if isinstance(response, dict)
                                     else None)
        if isinstance(usage, dict):
            for kind, names in (("prompt", ("prompt_tokens", "input_tokens")),
                                ("completion", ("completion_tokens", "output_tokens"))):
                value = next((usage[n] for n in names if isinstance(usage.get(n), int)), None)
                if value is not None:
                    t.child(t.tokens, model, kind).inc(value)
        for choice in doc.get("choices") or []:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                t.child(t.finish_reasons, model, str(reason)).inc()


def rename_answer(doc: dict[str, Any], model: str) -> bool:
    """The client's model name in an answer (top level, or a responses event's ``response``)."""
    renamed = False
    for holder in (doc, doc.get("response")):
        if isinstance(holder, dict) and "model" in holder:
            holder["model"] = model
            renamed = True
    return renamed


def renamed_event(item: SseEvent, doc: dict[str, Any] | None, model: str) -> bytes:
    """The event with the client's model name; its other lines (``event: …``) kept."""
    if doc is None or not rename_answer(doc, model):
        return item.raw
    lines = [ln for ln in item.raw.split(b"\n") if ln and not ln.startswith(b"data:")]
    return b"\n".join([*lines, b"data: " + json.dumps(doc).encode()]) + b"\n\n"
