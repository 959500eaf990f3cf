"""The fault filter's config: experiments, their actions and stop conditions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from proxy.call import CallKey
from proxy.lifecycle import ConfigReferences
from proxy.strict import Strict

SEEN: CallKey[list[str]] = CallKey("fault_experiments")
"""The experiments whose canary population this call belongs to (their windows count it)."""

FLOAT_TYPES = ("FP16", "FP32", "FP64")
INT_TYPES = ("INT32", "INT64")


class ActionBase(Strict):
    name: str = ""
    """Names the action in ``mmguard-fault`` and metrics; defaults to its kind."""
    percent: float = Field(100.0, ge=0.0, le=100.0)
    """Share of the experiment's calls that get this action."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Only calls with these headers (``"*"`` = any value) get this action."""

    @property
    def what(self) -> str:
        """The action's kind (each subclass narrows ``kind`` to its literals)."""
        return str(self.__dict__.get("kind", type(self).__name__))

    @property
    def label(self) -> str:
        return self.name or self.what


MAX_DELAY_MS = 600_000.0
"""The longest delay an action may give (10 minutes: longer than any deadline it would test)."""


class Delay(ActionBase):
    kind: Literal["delay"]
    ms: float | None = Field(None, ge=0, le=MAX_DELAY_MS)
    """A fixed delay."""
    mean_ms: float | None = Field(None, ge=0, le=MAX_DELAY_MS)
    std_ms: float = Field(0.0, ge=0, le=MAX_DELAY_MS)
    """Normal(mean_ms, std_ms), cut at 0 (the seeds' 50 ± 15 ms) and at ``MAX_DELAY_MS``."""
    min_ms: float | None = Field(None, ge=0, le=MAX_DELAY_MS)
    max_ms: float | None = Field(None, ge=0, le=MAX_DELAY_MS)
    """Uniform(min_ms, max_ms)."""

    @model_validator(mode="after")
    def _one_shape(self) -> Delay:
        shapes = [self.ms is not None, self.mean_ms is not None,
                  self.min_ms is not None or self.max_ms is not None]
        if sum(shapes) != 1:
            raise ValueError("give exactly one of: ms; mean_ms (+ std_ms); min_ms + max_ms")
        if shapes[2] and (self.min_ms is None or self.max_ms is None
                          or self.max_ms < self.min_ms):
            raise ValueError("a uniform delay needs min_ms <= max_ms")
        return self


class Abort(ActionBase):
    kind: Literal["abort"]
    http_status: int | None = Field(None, ge=400, le=599)
    grpc_code: str | None = None
    """e.g. UNAVAILABLE; with neither, 503 / UNAVAILABLE."""
    message: str = "fault injected"

    @model_validator(mode="after")
    def _code(self) -> Abort:
        if self.grpc_code is not None:
            import grpc
            if self.grpc_code.upper() not in grpc.StatusCode.__members__:
                raise ValueError(f"grpc_code '{self.grpc_code}' is not a gRPC status code name")
        return self


class InputAction(ActionBase):
    inputs: tuple[str, ...] = ()
    """v2 tensors to perturb; default: every tensor of the kind's type (images: floating point
    tensors of rank >= 3; tokens: INT32/INT64; text: BYTES). OpenAI calls: their images / texts."""


class Noise(InputAction):
    kind: Literal["gaussian_noise", "sign_noise"]
    sigma: float = Field(0.08, ge=0)
    """gaussian_noise: σ on [0, 1] pixels (0.08: the seeds' low-light figure)."""
    eps: float = Field(0.03, ge=0)
    """sign_noise: ε (FGSM's shape without gradients)."""
    lo: float = 0.0
    hi: float = 1.0


class Gradient(InputAction):
    kind: Literal["fgsm", "pgd"]
    eps: float = Field(0.03, ge=0)
    steps: int = Field(0, ge=0, le=100)
    """0: 1 for fgsm, 5 for pgd."""
    surrogate: Path
    """A TorchScript file: forward(image) -> the score to push (needs the ``torch`` extra)."""
    mode: Literal["lower", "raise"] = "lower"
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the surrogate's gradients run (cuda: a GPU torch build)."""
    lo: float = 0.0
    hi: float = 1.0


class PatchMask(InputAction):
    kind: Literal["patch_mask"]
    ratio: float = Field(0.25, ge=0, le=1)
    patch: int = Field(16, ge=1)
    tokens: str | None = None
    """A token-id tensor masked from the same seed as the image (a consistent cross-modal mask)."""
    pad_id: int = 0


class TokenDropout(InputAction):
    kind: Literal["token_dropout"]
    p: float = Field(0.15, ge=0, le=1)
    pad_id: int = 0
    keep_first: int = Field(0, ge=0)


class DropModality(InputAction):
    kind: Literal["drop_modality"]
    modality: Literal["image", "text"] | None = None
    """OpenAI calls: drop every image part (``image``); v2 calls: name the ``inputs``."""


class Precision(InputAction):
    kind: Literal["precision"]
    mode: Literal["round", "fp16", "bf16"] = "round"
    decimals: int = Field(3, ge=0, le=10)


class Degrade(InputAction):
    kind: Literal["blur", "darken", "quantise"]
    radius: float = Field(2.0, gt=0)
    factor: float = Field(0.3, ge=0)
    levels: int = Field(8, ge=2)


class TextCorrupt(InputAction):
    kind: Literal["mixed_scripts", "cut_text"]
    share: float = Field(0.3, ge=0, le=1)
    """mixed_scripts: share of Latin letters swapped for look-alikes."""
    keep: float = Field(0.5, ge=0, le=1)
    """cut_text: share of the text kept."""


class OutputFault(ActionBase):
    kind: Literal["nan_output", "truncate_output"]
    outputs: tuple[str, ...] = ()
    """v2 outputs to corrupt; default all. OpenAI answers: the message text."""
    share: float = Field(1.0, ge=0, le=1)
    """nan_output: share of the elements set to NaN."""
    keep: float = Field(0.5, ge=0, le=1)
    """truncate_output: share of each output's payload (or of the text) kept."""
    after_events: int = Field(4, ge=0)
    """truncate_output on a stream: content events kept before the text stops."""


class StreamFault(ActionBase):
    kind: Literal["slow_stream", "cut_stream", "reset"]
    ms: float = Field(100.0, ge=0, le=MAX_DELAY_MS)
    """slow_stream: delay before each event."""
    after_events: int = Field(2, ge=0)
    """cut_stream / reset of a stream: events passed before the cut."""


Action = Annotated[Delay | Abort | Noise | Gradient | PatchMask | TokenDropout | DropModality
                   | Precision | Degrade | TextCorrupt | OutputFault | StreamFault,
                   Field(discriminator="kind")]


class StopConditions(Strict):
    window_s: float = Field(30.0, gt=0)
    """The sliding window (the seeds: stop when a core SLO is out for 30 s)."""
    min_requests: int = Field(10, ge=1)
    """Judge only with at least this many canary answers in the window."""
    alpha: float = Field(0.01, gt=0, lt=0.5)
    """A stop is a test: the chance of stopping an experiment whose SLO holds, split evenly over
    the configured conditions. A rate stops when its confidence-sequence bound is past the
    limit, a p99 when its distribution-free lower bound is (filters/fault/rules.py)."""
    max_error_rate: float | None = Field(0.05, ge=0, le=1)
    """Share of the window's canary calls whose client got an error (injected ones included:
    what the client sees is what the SLO is about)."""
    max_p99_ms: float | None = Field(2000.0, gt=0)
    max_divergence: float | None = Field(None, ge=0, le=1)
    """Share of shadow comparisons on this route that disagreed (needs a ``shadow`` filter)."""
    # the chaos golden rules (baseline, success criterion, 15 s stop): filters/fault/rules.py
    baseline_calls: int = Field(0, ge=0)
    min_success: float | None = Field(None, ge=0, le=1)
    first_assertion_s: float = Field(15.0, gt=0)


class ExperimentConfig(Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    actions: tuple[Action, ...] = Field(min_length=1)
    headers: dict[str, str] = Field(default_factory=dict)
    """Within canary traffic, only calls with these headers."""
    share: float = Field(1.0, ge=0, le=1)
    """Blast radius: the share of the matching canary calls the experiment touches (stable by
    request key)."""
    max_active_faults: int | None = Field(None, ge=1)
    """At most this many calls under a fault at once (Envoy's max_active_faults)."""
    duration_s: float | None = Field(None, gt=0)
    """Stops by itself after this long; None: until a stop condition or an operator stops it."""
    seed: int = 0
    stop: StopConditions = StopConditions()


class FaultConfig(Strict):
    experiments: tuple[ExperimentConfig, ...] = ()
    """Experiments started with the config (again on each reload that changes them)."""

    @model_validator(mode="after")
    def _unique(self) -> FaultConfig:
        names = [e.name for e in self.experiments]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment names must be unique: {names}")
        return self

    def references(self) -> ConfigReferences:
        """Experiment names (process-wide) and surrogate files (checked at load)."""
        return ConfigReferences(
            unique_names=tuple(("experiment", e.name) for e in self.experiments),
            files=tuple((f"experiments[{i}].actions[{j}].surrogate", a.surrogate)
                        for i, e in enumerate(self.experiments)
                        for j, a in enumerate(e.actions) if isinstance(a, Gradient)))


