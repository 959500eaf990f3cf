"""``quality.intent``: each deployment intent's rule set, read off the ROC (docs/quality.md,
"Deployment intents"); a route lists its rules in full or names an intent, never both; the
intent decides which of the costly scene signals are measured at all."""

from __future__ import annotations

import numpy as np
import pytest

from filters.quality.filter import QualityConfig
from filters.quality.rules import DEFAULT_RULES, INTENT_RULES, RECALL_RULES, SCREEN_RULES
from filters.quality.scenes import OPTIONAL_SIGNALS
from filters.quality.signals import ImageSpec, image_signals
from proxy.config.model import ConfigError, parse_config
from tests.support import photos

CONFIG = {"backends": [{"kind": "onnxruntime", "name": "local", "model_dir": "/models"}],
          "models": [{"name": "clip", "backend": "local"}]}


def _route(quality: dict[str, object]) -> dict[str, object]:
    return {**CONFIG, "models": [{"name": "clip", "backend": "local",
                                  "filters": [{"quality": quality}]}]}


def _points(rules: tuple[object, ...]) -> dict[str, float]:
    return {r.signal: r.below for r in rules}  # type: ignore[attr-defined]


def test_no_intent_is_the_photos_intent_the_shipped_defaults() -> None:
    assert QualityConfig().rules == DEFAULT_RULES
    assert QualityConfig(intent="photos").rules == DEFAULT_RULES
    assert QualityConfig().intent == "photos"


def test_each_intent_gets_its_rules_and_listed_rules_are_kept_as_listed() -> None:
    for name, rules in INTENT_RULES.items():
        assert QualityConfig.model_validate({"intent": name}).rules == rules
    listed = QualityConfig.model_validate({"rules": [
        {"signal": "moire", "below": 0.3, "action": "annotate"}]})
    assert _points(listed.rules) == {"moire": 0.3}
    assert QualityConfig.model_validate({"rules": []}).rules == ()


def test_screens_is_the_defaults_plus_moire_ghosting_and_residue_at_their_documented_point(
        ) -> None:
    assert SCREEN_RULES[:len(DEFAULT_RULES)] == DEFAULT_RULES
    extra = SCREEN_RULES[len(DEFAULT_RULES):]
    assert {(r.signal, r.below, r.action) for r in extra} == {
        ("moire", 0.5, "annotate"), ("ghosting", 0.5, "annotate"),
        ("residue", 0.5, "annotate")}


def test_recall_lowers_no_bar_and_refuses_only_what_the_defaults_refuse() -> None:
    default, recall = _points(DEFAULT_RULES), _points(RECALL_RULES)
    assert set(recall) == set(default)
    assert all(recall[s] >= default[s] for s in default), (recall, default)
    assert [r.signal for r in RECALL_RULES if r.action == "reject"] == ["finite"]


def test_an_intent_and_rules_together_are_refused_with_the_key_path() -> None:
    doc = _route({"images": {"pixel_values": {}}, "intent": "screens", "rules": []})
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    message = str(exc.value)
    assert "models[0].filters[0].quality" in message, message
    assert "give intent or rules, not both" in message and "'screens'" in message, message


def test_an_unknown_intent_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_route({"intent": "documents"}))
    message = str(exc.value)
    assert "models[0].filters[0].quality.intent" in message, message
    assert "'photos', 'recall' or 'screens'" in message, message


def test_the_intent_decides_which_costly_scene_signals_are_measured() -> None:
    """What the filter measures follows its rules: the screens intent's moiré and ghosting
    are measured (and flag a ghosted photograph); the default intent measures neither."""
    for name, wanted in (("photos", set()), ("recall", set()), ("screens",
                                                                 {"moire", "ghosting",
                                                                  "residue"})):
        rules = QualityConfig.model_validate({"intent": name}).rules
        assert {r.signal for r in rules} & OPTIONAL_SIGNALS == wanted, name
    source = next(c.image for c in photos.clean_set() if c.name == "astronaut")
    h, w = source.shape[:2]
    shifted = source[np.clip(np.arange(h) - 9, 0, h - 1)][:, np.clip(np.arange(w) - 5, 0, w - 1)]
    ghosted = np.asarray(0.8 * source + 0.2 * shifted).round().astype(np.uint8)
    spec = ImageSpec("HWC", (0.0,), (255.0,))
    screens = _points(SCREEN_RULES)
    clean = image_signals(source, spec, frozenset({"ghosting"}))
    bad = image_signals(ghosted, spec, frozenset({"ghosting"}))
    assert clean["ghosting"].score >= screens["ghosting"] > bad["ghosting"].score
    assert "ghosting" not in image_signals(ghosted, spec, frozenset())
