"""vLLM's words for the request mistakes mmguard's OpenAI front finds before vLLM would.

vLLM validates a request against its pydantic model and answers each mistake as FastAPI's
``RequestValidationError`` reports it: ``N validation error(s):`` then each error as a dict
(``{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': ...}``), with
``"type": "Bad Request"`` and the error's location as ``param``; a few it finds later in plain
sentences (an empty conversation, a completion without a prompt). mmguard reads the fields its
guards need first, and refused those mistakes in its own words (``'messages' must be a
non-empty list``), which no vLLM client recognises. Here are vLLM's, for the single-error cases
mmguard finds; mistakes pydantic reports as many errors at once (a part of an unknown type
fails every member of a union) keep mmguard's own sentence.

What MUST hold: each text here is what vLLM 0.32's server says for the same body, checked
against a real vLLM (``tests/conformance/test_vllm_parity.py``).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.errors import ErrorKind, ProxyError

EMPTY_CONVERSATION = ("Cannot apply chat template to an empty conversation. Provide at least "
                      "one message.")
NO_PROMPT = ("Either prompt or prompt_embeds must be provided and non-empty. "
             "(parameter=prompt)")


def _shown(value: Any) -> str:
    """A value as vLLM shows it in a validation error (containers by their size)."""
    if isinstance(value, (dict, list)):
        return f"'<{type(value).__name__} of {len(value)} items>'"
    return repr(str(value))


def validation_error(loc: str, kind: str, msg: str, value: Any, ctx: str | None = None
                     ) -> ProxyError:
    """One validation error of vLLM's request model, answered as vLLM answers it."""
    text = (f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', "
            f"'input': {_shown(value)}" + (f", 'ctx': {{'error': {ctx!r}}}" if ctx else "")
            + "}")
    return validation_error_text(text, loc)


def not_json(exc: json.JSONDecodeError) -> ProxyError:
    return validation_error(f"body.{exc.pos}", "json_invalid", "JSON decode error", {},
                            ctx=exc.msg)


def missing(loc: str, holder: Any) -> ProxyError:
    return validation_error(loc, "missing", "Field required", holder)


def not_a_list(loc: str, value: Any) -> ProxyError:
    return validation_error(loc, "list_type", "Input should be a valid list", value)


def not_a_string(loc: str, value: Any) -> ProxyError:
    return validation_error(loc, "string_type", "Input should be a valid string", value)


def not_utf8() -> ProxyError:
    """A body that is not UTF-8: Starlette's words, before vLLM's model reads anything."""
    body = json.dumps({"detail": "There was an error parsing the body"},
                      separators=(",", ":")).encode()
    return ProxyError(ErrorKind.INVALID_ARGUMENT, "There was an error parsing the body",
                      status=400, body=body)


def media_type() -> ProxyError:
    """A body not sent as ``application/json``: vLLM's check, in its words and shape."""
    return validation_error_text("1 validation error:\n  Unsupported Media Type: Only "
                                 "'application/json' is allowed", None)


def validation_error_text(text: str, loc: str | None) -> ProxyError:
    body = json.dumps({"error": {"message": text, "type": "Bad Request", "param": loc,
                                 "code": 400}}, separators=(",", ":")).encode()
    return ProxyError(ErrorKind.INVALID_ARGUMENT, text, param=loc, status=400, body=body)


def not_an_object(value: Any) -> ProxyError:
    if value is None:  # a body of ``null`` is no body to FastAPI
        return missing("body", None)
    return validation_error("body", "model_attributes_type", "Input should be a valid "
                            "dictionary or object to extract fields from", value)
