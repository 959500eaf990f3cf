"""The quality filter's rules, and the rule set of each deployment intent.

Each threshold is read off the ROC of its signal on real photographs (``bench/quality_eval.py``;
docs/quality.md, "Operating points" and "Deployment intents"): a route names an intent, or lists
its rules in full.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from filters.quality.signals import IMAGE_SIGNALS, REQUEST_SIGNALS
from filters.quality.text import TEXT_SIGNALS
from proxy.strict import Strict

SCORES = ("image", "text", "alignment", "trust")


class Rule(Strict):
    signal: str
    """An image or text signal, a modality score ('image', 'text'), 'alignment' or 'trust'."""
    below: float = Field(ge=0.0, le=1.0)
    """The rule fires when the score is below this."""
    action: Literal["annotate", "reject", "drop-modality"]

    @model_validator(mode="after")
    def _check(self) -> Rule:
        known = (*IMAGE_SIGNALS, *REQUEST_SIGNALS, *TEXT_SIGNALS, *SCORES)
        if self.signal not in known:
            raise ValueError(f"unknown signal '{self.signal}' (known: {', '.join(known)})")
        if self.action == "drop-modality" and self.signal in ("alignment", "trust"):
            raise ValueError(f"drop-modality needs an image or text signal, not '{self.signal}'")
        return self


# Each threshold from the ROC on real photographs (bench/quality_eval.py; docs/quality.md,
# "Operating points"): the highest on a 0.05 grid that flags none of the 267 clean photographs
# (the evaluation framing and random crops), so that all rules together stay within 1 % on
# crops; capped at 0.5 where the ROC leaves more room (fewer alarms on screenshots and
# illustrations, which that budget does not cover), except exposure: 0.6, the highest that
# flags none of the documents, screenshots and illustrations either (a dark-mode UI reads
# 0.69, a levelled page 0.70; photographs 0.99 and up).
DEFAULT_RULES = (Rule(signal="finite", below=1.0, action="reject"),
                 Rule(signal="range", below=0.5, action="annotate"),
                 Rule(signal="sharpness", below=0.55, action="annotate"),
                 Rule(signal="exposure", below=0.6, action="annotate"),
                 Rule(signal="noise", below=0.3, action="annotate"),
                 Rule(signal="blockiness", below=0.5, action="annotate"),
                 Rule(signal="perspective", below=0.5, action="annotate"),
                 Rule(signal="tone", below=0.1, action="annotate"),
                 Rule(signal="shake", below=0.5, action="annotate"))
RECALL_POINTS = {"range": 0.95, "sharpness": 0.6, "noise": 0.35, "blockiness": 0.95,
                 "perspective": 0.95, "tone": 0.3, "shake": 0.95}
RECALL_RULES = tuple(r.model_copy(update={"below": RECALL_POINTS[r.signal]})
                     if r.signal in RECALL_POINTS else r for r in DEFAULT_RULES)
"""Each signal at the highest threshold that flags at most 1 % of the clean photographs and
random crops on its own (docs/quality.md, "Operating points"): more caught, more alarms (3.6 %
of the random crops together). Exposure keeps the default's 0.6: its 1 % point (0.95) also
flags levelled pages, dark-mode screenshots and half the high-key scenes."""
SCREEN_RULES = (*DEFAULT_RULES,
                Rule(signal="moire", below=0.5, action="annotate"),
                Rule(signal="ghosting", below=0.5, action="annotate"),
                Rule(signal="residue", below=0.5, action="annotate"))
"""The defaults, and the scene signals of phone pictures of screens and OCR residue at the
point that flags no clean photograph, crop, document or screenshot (moiré: only a checkerboard;
ghosting: one rendered UI of eight; residue, on requests of several images: no pair of
unrelated pictures, 0.4 % of pairs of frames of one scene). The FFTs of moiré and ghosting
cost more than every default signal together."""
INTENT_RULES = {"photos": DEFAULT_RULES, "recall": RECALL_RULES, "screens": SCREEN_RULES}


Intent = Literal["photos", "recall", "screens"]


def rules_of(data: Any) -> Any:
    """A quality config as given, with the rules of its intent where it lists none; both given
    is an error (the rules would silently replace the intent's)."""
    if not isinstance(data, dict):
        return data
    if "rules" not in data:
        intent = data.get("intent", "photos")
        return {**data, "rules": INTENT_RULES[intent]} if intent in INTENT_RULES else data
    if "intent" in data:
        raise ValueError(f"give intent or rules, not both: rules replace the rules of intent "
                         f"'{data['intent']}' (list them in full; docs/quality.md, \"Deployment "
                         f"intents\", has each intent's rules)")
    return data
