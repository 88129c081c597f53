"""What a decoder layer keeps for backward, as fits in the micro-batch and sequence: measured from
a block's own code by `launcher/estimate/activations.py` for blocks the analytic model does not
know, and read by the estimate (`launcher/estimate/analytic_activations.py`) through the model's
shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BOUND_FACTOR = 2.0  # the conservative bound: this many llama-style blocks of the same sizes


@dataclass(frozen=True)
class Fit:
    """Bytes one decoder layer keeps for backward: const + per_token*b*s + per_token_sq*b*s*s."""

    const: float
    per_token: float
    per_token_sq: float

    def bytes(self, b: int, s: int) -> int:
        return round(self.const + self.per_token * b * s + self.per_token_sq * b * s * s)

    @classmethod
    def through(cls, half_1: float, half_2: float, full_1: float, s: int) -> Fit:
        """The fit through bytes at (b=1, s/2), (b=2, s/2) and (b=1, s)."""
        h = s / 2
        d_batch = half_2 - half_1  # per_token * h + per_token_sq * h^2
        d_seq = full_1 - half_1  # per_token * h + per_token_sq * 3 h^2
        sq = (d_seq - d_batch) / (2 * h * h)
        per_token = (d_batch - sq * h * h) / h
        return cls(half_1 - per_token * h - sq * h * h, per_token, sq)


@dataclass(frozen=True)
class LayerActivations:
    """What one decoder layer keeps for backward, per compute mode (mean over the layers)."""

    source: str  # "traced" (measured from the model's code) or "bound" (conservative)
    fits: dict[str, Fit]  # compute mode -> fit
    seq_len: int  # the sequence length measured at
    num_layer_kinds: int = 1
    note: str = ""  # why a bound: the trace's error
    # saved once for all layers: inputs every layer reads (rotary cos/sin), per mode
    shared: dict[str, Fit] = field(default_factory=dict)
    # saved after the last layer: final norm, the head's input (and 16-bit weight), per mode
    final: dict[str, Fit] = field(default_factory=dict)
    # a layer's transients: in backward beyond its saved tensors and parameter gradients, in
    # forward beyond what it saves; calibrated against traced steps, per mode
    backward: dict[str, Fit] = field(default_factory=dict)
    forward: dict[str, Fit] = field(default_factory=dict)
    # the attention calls PyTorch's flash kernel takes on a GPU, unpacked in 16 bits: [query
    # heads, key/value heads, head size] (saved_tensors.flash_attention_calls)
    flash_calls: list[list[int]] = field(default_factory=list)
    # `fits` where attention runs without a mask (one document a row, or flash-attn): grouped
    # key/value heads are saved as they are, not repeated for SDPA's masked kernels (SDPA only)
    unmasked: dict[str, Fit] = field(default_factory=dict)

    def layer_bytes(self, mode: str, b: int, s: int, masked: bool = True) -> int:
        return _at(self.fits if masked or not self.unmasked else self.unmasked, mode, b, s)

    def shared_bytes(self, mode: str, b: int, s: int) -> int:
        return _at(self.shared, mode, b, s)

    def final_bytes(self, mode: str, b: int, s: int) -> int:
        return _at(self.final, mode, b, s)

    def backward_bytes(self, mode: str, b: int, s: int) -> int:
        """May be negative: a correction to the estimate's backward phase of a layer."""
        fit = self.backward.get(mode)
        return fit.bytes(b, s) if fit else 0

    def forward_bytes(self, mode: str, b: int, s: int) -> int:
        return _at(self.forward, mode, b, s)

    def reason(self, model_type: str) -> str:
        if self.source == "traced":
            kinds = f" ({self.num_layer_kinds} kinds of layer)" if self.num_layer_kinds > 1 else ""
            return (
                f"activations of the {model_type} decoder layers{kinds} measured by tracing "
                "the model's own forward under fake tensors (cached)"
            )
        return (
            f"activations of the {model_type} decoder layers are a conservative bound "
            f"({BOUND_FACTOR:g}x a llama-style block of the same sizes plus eager attention): "
            f"{self.note}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerActivations:
        fits = {part: {k: Fit(**v) for k, v in d[part].items()} for part in PARTS}
        return cls(**{**d, **fits})


PARTS = ("fits", "shared", "final", "backward", "forward", "unmasked")


def _at(fits: dict[str, Fit], mode: str, b: int, s: int) -> int:
    """A part's bytes in `mode` (the largest mode's where not measured in it)."""
    if not fits:
        return 0
    fit = fits.get(mode) or max(fits.values(), key=lambda f: f.bytes(b, s))
    return max(0, fit.bytes(b, s))


def compute_mode(c: int, autocast: bool) -> str:
    """The mode a micro-batch computes in (estimate._Micro's c and autocast)."""
    if c == 4:
        return "fp32"
    return "autocast" if autocast else "lowp"
