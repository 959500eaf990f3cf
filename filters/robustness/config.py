"""The ``shadow.robustness`` block: which perturbations run on mirrored copies, at what rate,
and the thresholds its verdict reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from filters.compare import CompareConfig
from proxy.strict import Strict

PerturbationKind = Literal["gaussian_noise", "sign_noise", "patch_mask", "token_dropout",
                           "occlusion", "precision", "drop_modality", "low_light"]


class Perturbation(Strict):
    kind: PerturbationKind
    name: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")
    """How the report and the verdict name it (default: the kind)."""
    sigma: float = Field(0.08, ge=0)
    """gaussian_noise: σ of the noise on pixels in [0, 1] (clamped)."""
    eps: float = Field(0.03, ge=0)
    ratio: float = Field(0.25, ge=0, le=1)
    patch: int = Field(16, ge=1)
    p: float = Field(0.15, ge=0, le=1)
    pad_id: int = 0
    area: float = Field(0.2, ge=0, le=1)
    mode: Literal["round", "fp16", "bf16"] = "round"
    decimals: int = Field(3, ge=0, le=10)
    factor: float = Field(0.3, gt=0, le=1)
    """low_light: pixels are scaled by this, then ``noise`` σ is added."""
    noise: float = Field(0.02, ge=0)
    inputs: tuple[str, ...] = ()
    """v2 inputs to perturb (drop_modality: to remove); empty: every input of the right kind."""

    @property
    def label(self) -> str:
        return self.name or self.kind


class RobustnessConfig(Strict):
    perturbations: tuple[Perturbation, ...] = Field(min_length=1)
    percent: float = Field(100.0, ge=0, le=100)
    """Share of the mirrored copies the experiment draws (stable by request key)."""
    max_qps: float = Field(10.0, gt=0)
    """Production's extra calls per second at most (each drawn copy costs one per perturbation);
    a copy over the cap is not perturbed (``mmguard_robustness_skipped_total{reason="cap"}``)."""
    seed: int = 0
    window: int = Field(500, ge=1)
    """Paired samples kept per perturbation."""
    min_samples: int = Field(20, ge=1)
    """Per perturbation, before it is judged (and before the verdict may promote)."""
    compare: CompareConfig | None = None
    """How a perturbed answer is held to its side's clean one (what "kept" means); None: the
    shadow's own ``compare``. A perturbation moves answers more than a release does, so this is
    usually looser (e.g. ``cosine_min: 0.9``, or ``classification`` for top-1 kept)."""
    max_drop: float = Field(0.05, ge=0, le=1)
    """The margin: the canary's robustness may be at most this far below production's (as a
    share: 0.05 = 5 points) on every perturbation measured; further below aborts."""

    @model_validator(mode="after")
    def _unique(self) -> RobustnessConfig:
        labels = [p.label for p in self.perturbations]
        if len(set(labels)) != len(labels):
            raise ValueError(f"perturbation names must be unique (give 'name' to tell two of one "
                             f"kind apart): {labels}")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples {self.min_samples} can never be reached in a window "
                             f"of {self.window}")
        return self


# --- statistics --------------------------------------------------------------------------------
