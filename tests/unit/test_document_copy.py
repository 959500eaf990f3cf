"""``document_copy``: what a copy of an OpenAI call (a fallback level, a retry) may edit without
touching the client's document — equal to a JSON round trip, without re-encoding the text."""

from __future__ import annotations

import json
from typing import Any

from proxy.call import document_copy

DOC: dict[str, Any] = {
    "model": "llava", "max_tokens": 16, "temperature": 0.0, "stream": False, "seed": None,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is it? \u00e9\u4e2d"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4096}},
        ]},
    ],
    "stop": ["\n\n", "###"], "logit_bias": {"50256": -100},
}


def test_the_copy_equals_a_json_round_trip() -> None:
    copy = document_copy(DOC)
    assert copy == json.loads(json.dumps(DOC)) == DOC
    assert json.dumps(copy) == json.dumps(DOC)  # the same body when it is encoded again
    assert document_copy({"stop": ("a", "b")}) == json.loads(json.dumps({"stop": ("a", "b")}))


def test_editing_the_copy_leaves_the_original_as_it_was() -> None:
    original = json.loads(json.dumps(DOC))
    copy = document_copy(original)
    copy["messages"][1]["content"].pop()  # a level drops the image part
    copy["messages"][0]["content"] = "changed"
    copy["stop"].append("x")
    copy["logit_bias"]["1"] = 5
    copy["max_tokens"] = 1
    assert original == DOC


def test_every_container_is_new_and_every_leaf_shared() -> None:
    copy = document_copy(DOC)

    def pairs(a: Any, b: Any) -> list[tuple[Any, Any]]:
        if isinstance(a, dict):
            return [(a, b), *(p for k in a for p in pairs(a[k], b[k]))]
        if isinstance(a, list):
            return [(a, b), *(p for x, y in zip(a, b, strict=True) for p in pairs(x, y))]
        return [(a, b)]

    for a, b in pairs(DOC, copy):
        if isinstance(a, (dict, list)):
            assert a is not b
        else:
            assert a is b  # an image's base64 text is not copied
