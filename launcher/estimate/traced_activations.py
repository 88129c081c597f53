"""Activations of decoder blocks the analytic model does not know: measured from the model's own
code, or bounded when its code cannot be traced.

`launcher/estimate/peak.py` describes llama-style blocks (MODELLED_TYPES) in closed form. Any other
block is measured: the model runs one forward under FakeTensorMode (shapes and dtypes, no
storage) and a saved-tensor hook on one layer of each kind records what autograd keeps for that
layer's backward (`launcher/estimate/saved_tensors.py`: each distinct storage once; parameters
and the inputs every layer shares, such as the mask and rotary tables, not counted: the estimate
counts those once). Three runs, at (b, s/2), (b=2, s/2) and (b, s), fit

    bytes per layer = const + per_token * b * s + per_token_sq * b * s * s

(const: autocast's 16-bit weight copies; per token: the projections, norms, MLP, the experts a
token is routed to; per token squared: attention probabilities and masks), in each compute mode
the rungs run: autocast over fp32 weights (single, ddp, DeepSpeed), 16-bit weights without
autocast (FSDP's mixed precision), or fp32 throughout. A checkpointed layer keeps only its input,
as for known blocks. Layers of several kinds (sliding and global attention, dense and MoE
layers) are measured one of each kind and averaged over the model's layers.

What is measured here is cached and bounded by `launcher/estimate/activations.py`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from launcher.estimate.layer_fits import PARTS, Fit, LayerActivations
from launcher.estimate.peak import estimate
from launcher.estimate.saved_tensors import (
    flash_attention_calls,
    kind_sequence,
    saved_point,
    structure,
    traced_attention,
)
from launcher.estimate.shape import shape_of
from launcher.estimate.trace_pool import on_two_cores
from trainer.core.step_spec import StepSpec

log = logging.getLogger(__name__)

MODES = {"fp32": ("fp32",), "bf16": ("autocast", "lowp"), "fp16": ("autocast", "lowp")}


def trace_layer_activations(
    hf_config: dict[str, Any], seq_len: int, precision: str, attn_implementation: str = "sdpa"
) -> LayerActivations:
    """Measure one layer of each kind in every compute mode of `precision` (see the module doc):
    what it saves, then its transients against traced steps, on a copy of the model cut to
    `reduced_depth` layers where that is exact. The forwards that count saved tensors and the
    traced steps all run at once, over two cores where there are two. A copy a structure's
    period deep stands for kinds of one structure only where those kinds saved the same bytes;
    otherwise the copy is traced again a kinds' period deep."""
    configured, attn_implementation = attn_implementation, traced_attention(attn_implementation)
    kinds = kind_sequence(hf_config, attn_implementation)
    depth = reduced_depth(hf_config, attn_implementation, by_structure=True, kinds=kinds)
    acts, per_kind = _measure(hf_config, kinds, depth, seq_len, precision, configured)
    if not _same_bytes_per_structure(per_kind):
        by_kinds = reduced_depth(hf_config, attn_implementation, kinds=kinds)
        if by_kinds != depth:  # the copy merged kinds that differ: trace one that keeps them
            log.debug("kinds of one structure saved different bytes: %d layers deep", by_kinds)
            acts, _ = _measure(hf_config, kinds, by_kinds, seq_len, precision, configured)
    return acts


def _measure(hf_config, kinds, depth, seq_len, precision, configured):
    """(the saved fits with their transients, what each kind saved at each point and mode),
    from the model cut to `depth` layers (0: the whole model), its attention `configured` and
    traced as `traced_attention` of it."""
    config = at_depth(hf_config, depth) if depth else hf_config
    s = even_seq_len(seq_len)
    attn_implementation = traced_attention(configured)
    saved_jobs = _saved_jobs(config, precision, attn_implementation, s)
    # without a mask (SDPA on one document a row, flash-attn): grouped key/value heads kept
    unmasked_jobs = (
        _saved_jobs(config, precision, attn_implementation, s, packed=False)
        if attn_implementation == "sdpa"
        else []
    )
    keys, peak_jobs = _peak_jobs(config, precision, attn_implementation, s)
    flash_jobs = _flash_jobs(config, precision, configured, s)
    results = iter(_on_two_cores([*saved_jobs, *unmasked_jobs, *peak_jobs, *flash_jobs]))
    saved, unmasked, peak_results, flash = (
        [next(results) for _ in jobs] for jobs in (saved_jobs, unmasked_jobs, peak_jobs, flash_jobs)
    )
    acts = _saved_fits(saved, precision, seq_len, kinds)
    if unmasked:
        acts = replace(acts, unmasked=_saved_fits(unmasked, precision, seq_len, kinds).fits)
    acts = replace(acts, flash_calls=flash[0] if flash else [])
    peaks = _peaks(keys, peak_results)
    return _with_transients(acts, config, precision, peaks), [r[0] for r in saved]


def _same_bytes_per_structure(per_kind: list[dict[tuple, int]]) -> bool:
    """Whether every kind of layer saved what the other kinds of its structure saved."""
    for point in per_kind:
        by_structure: dict[tuple, set[int]] = {}
        for kind, saved in point.items():
            by_structure.setdefault(structure(kind), set()).add(saved)
        if any(len(values) > 1 for values in by_structure.values()):
            return False
    return True


# The depth of the copy traced instead of a deep model with one kind of layer. What a layer saves
# does not depend on the depth, and nor do its transients (the traced step's largest layer peak
# less the estimate's same phase for the same depth) from 3 layers on, but for the allocator's
# rounding of a layer's small tensors: 24 B to 8 KB a layer in bench.models_trace's nine types
# (copies of 3, 4 and 8 layers), 0.03 MiB for gpt-oss-20b's shape, 0 for Qwen3-235B-A22B's.
# 2 layers is a special case under FSDP: its backward transient is 6 KB there against 336 KB
# from 3 layers on (gpt_neox hidden 128, seq 256). Kinds that repeat with a period p (gpt-oss's
# sliding and full attention: p = 2) take a copy p times as deep, so every kind keeps its share
# and its bottom, second and top layers; kinds of one structure (sliding and full attention over
# the same modules) count as one where they save the same bytes.
REDUCED_DEPTH = 3
MAX_PERIOD = 4  # a longer pattern of kinds traces the whole model
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _depth_key(hf_config: dict[str, Any]) -> str:
    """The config key that holds the layer count, as the HF config class spells it (its
    `attribute_map` sends `num_hidden_layers` to e.g. GPT-2's `n_layer`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[hf_config["model_type"]]
    mapped = getattr(cls, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    return next((k for k in (mapped, *_DEPTH_KEYS) if k in hf_config), mapped)


def at_depth(hf_config: dict[str, Any], depth: int) -> dict[str, Any]:
    """A copy of the config with `depth` layers, per-layer lists (`layer_types`, any list as
    long as the model is deep) cut to their first `depth` entries."""
    layers = shape_of(json.dumps(hf_config, sort_keys=True)).num_layers
    out = {
        k: v[:depth] if isinstance(v, list) and len(v) == layers else v
        for k, v in hf_config.items()
    }
    out[_depth_key(hf_config)] = depth
    return out


def reduced_depth(
    hf_config: dict[str, Any],
    attn_implementation: str,
    by_structure: bool = False,
    kinds: list[tuple] | None = None,
) -> int:
    """The depth of the copy traced for this model: `REDUCED_DEPTH` times the period of its
    kinds of layer (of their structures, `by_structure`, where the copy holds every kind),
    where the model is deeper, its depth is whole periods and the copy builds with exactly the
    first layers of the model; 0 to trace the whole model (a kind pattern that does not repeat,
    such as DeepSeek's first dense layers, could take another share in a cut copy)."""
    kinds = kinds or kind_sequence(hf_config, attn_implementation)
    layers = len(kinds)
    period = _period(kinds)
    if by_structure and period is not None:
        period = _period([structure(k) for k in kinds])
        if set(kinds[: REDUCED_DEPTH * period]) != set(kinds):
            period = _period(kinds)
    if period is None or layers % period or layers <= REDUCED_DEPTH * period:
        return 0
    depth = REDUCED_DEPTH * period
    try:
        cut = kind_sequence(at_depth(hf_config, depth), attn_implementation)
    except Exception as err:  # a config whose copy does not build: trace the whole model
        log.debug("no %d-layer copy of %s: %s", depth, hf_config["model_type"], err)
        return 0
    return depth if cut == kinds[:depth] else 0


def _period(kinds: list[tuple]) -> int | None:
    """The shortest period, up to MAX_PERIOD, with which `kinds` repeat from the first layer."""
    periods = range(1, MAX_PERIOD + 1)
    return next((p for p in periods if all(k == kinds[i % p] for i, k in enumerate(kinds))), None)


def saved_activations(
    hf_config: dict[str, Any], seq_len: int, precision: str, attn_implementation: str = "sdpa"
) -> LayerActivations:
    """What each part keeps for backward (layers, shared inputs, final), fitted per mode."""
    jobs = _saved_jobs(hf_config, precision, attn_implementation, even_seq_len(seq_len))
    kinds = kind_sequence(hf_config, attn_implementation)
    return _saved_fits([_run(job) for job in jobs], precision, seq_len, kinds)


def calibrate_transients(
    hf_config: dict[str, Any],
    seq_len: int,
    precision: str,
    attn_implementation: str = "sdpa",
    depth: int = 0,
) -> LayerActivations:
    """The saved fits with each layer's forward and backward transients: what the traced step
    (the engine's step under fake tensors, launcher/estimate/trace.py) peaks at in a layer's
    forward (no checkpointing) and backward (full checkpointing) beyond the estimate's same
    phase without them, at the three points, per mode (single for autocast and fp32, fsdp x4
    for 16-bit parameters), on the whole model or its copy `depth` layers deep."""
    kinds = kind_sequence(hf_config, traced_attention(attn_implementation))
    acts, _ = _measure(hf_config, kinds, depth, seq_len, precision, attn_implementation)
    return acts


def even_seq_len(seq_len: int) -> int:
    """The sequence the fits are measured at: even, so that its half is a whole point."""
    return max(2, seq_len - seq_len % 2)


def _saved_jobs(hf_config, precision, attn_implementation, s, packed=True) -> list[tuple]:
    """One forward per mode and point, counting what each layer saves (`saved_point`), of
    packed windows or of one document a row."""
    return [
        ("saved", hf_config, mode, precision, attn_implementation, b, seq, False, packed)
        for mode in MODES[precision]
        for b, seq in points(s)
    ]


def _flash_jobs(hf_config, precision, configured, s) -> list[tuple]:
    """Where flash can attend (`sdpa` or flash-attn, in 16 bits): one forward that records the
    attention calls a flash kernel takes (`flash_attention_calls`)."""
    if precision == "fp32" or traced_attention(configured) != "sdpa":
        return []
    return [("flash", hf_config, precision, configured, s)]


def _saved_fits(results: list, precision: str, seq_len: int, kinds: list[tuple]):
    """The saved tensors' fits from `_saved_jobs`' results, in their order, a layer's the mean
    over the model's layers (`kinds`, each layer's kind)."""
    s = even_seq_len(seq_len)
    parts: dict[str, dict[str, Fit]] = {part: {} for part in PARTS}
    points_per_mode = len(points(s))
    for k, mode in enumerate(MODES[precision]):
        mine = results[k * points_per_mode : (k + 1) * points_per_mode]
        means = [sum(per_kind[kind] for kind in kinds) / len(kinds) for per_kind, _, _ in mine]
        parts["fits"][mode] = Fit.through(*means, s)
        for i, part in ((1, "shared"), (2, "final")):
            parts[part][mode] = Fit.through(*(saved[i] for saved in mine), s)
    return LayerActivations("traced", parts["fits"], seq_len, num_layer_kinds=len(set(kinds)),
                            shared=parts["shared"], final=parts["final"])  # fmt: skip


def _with_transients(
    acts: LayerActivations,
    hf_config: dict[str, Any],
    precision: str,
    peaks: dict[tuple[str, str], list[dict[int, int]]],
) -> LayerActivations:
    """`acts` with the transients fitted from the layer peaks traced on `hf_config` (the whole
    model or its copy): the largest layer peak less the estimate of the same phase for the same
    depth, without transients, at each point."""
    s = even_seq_len(acts.seq_len)
    shape = replace(shape_of(json.dumps(hf_config, sort_keys=True)), activations=acts)
    fits: dict[str, dict[str, Fit]] = {"backward": {}, "forward": {}}
    for (mode, part), at_points in peaks.items():
        strategy, world = _TRANSIENT_RUNG[mode == "lowp"]
        ckpt, _, phase = _TRANSIENT_PHASE[part]
        transients = [
            max(peak.values())
            - estimate(shape, StepSpec(strategy, world, b, seq, ckpt, precision)).phases[phase]
            for peak, (b, seq) in zip(at_points, points(s), strict=True)
        ]
        fits[part][mode] = Fit.through(*transients, s)
    return replace(acts, backward=fits["backward"], forward=fits["forward"])


# (strategy, world size) the transients are traced on: single, or fsdp x4 for 16-bit weights
_TRANSIENT_RUNG = {False: ("single", 1), True: ("fsdp", 4)}
# part -> (checkpointing, the traced step's phase label, the estimate's phase)
_TRANSIENT_PHASE = {
    "backward": ("full", "backward layer ", "backward_layers"),
    "forward": ("none", "forward layer ", "forward_layers"),
}


def points(s: int) -> tuple[tuple[int, int], ...]:
    """The (micro-batch, sequence) points every fit goes through."""
    return ((1, s // 2), (2, s // 2), (1, s))


def _peak_jobs(
    hf_config: dict[str, Any], precision: str, attn_implementation: str, s: int
) -> tuple[list[tuple], list[tuple]]:
    """(keys, jobs): per mode, point and part, the `layer_phase_peaks` arguments."""
    keys = [
        (mode, part, point)
        for mode in MODES[precision]
        for point in points(s)
        for part in _TRANSIENT_PHASE
    ]
    jobs = [
        (hf_config, mode, part, b, seq, precision, attn_implementation)
        for mode, part, (b, seq) in keys
    ]
    return keys, jobs


def _peaks(keys: list[tuple], results: list[dict[int, int]]):
    """(mode, "backward" | "forward") -> at each of `points`, the traced step's peak in each
    layer's phase of that part (layer index -> bytes)."""
    out: dict[tuple[str, str], list[dict[int, int]]] = {}
    for (mode, part, _), peaks in zip(keys, results, strict=True):
        out.setdefault((mode, part), []).append(peaks)
    return out


def _run(job: tuple) -> Any:
    """One measurement: `layer_phase_peaks(*job)`, a saved-tensor forward ("saved", ...) or the
    flash probe ("flash", ...)."""
    if job[0] == "saved":
        return saved_point(*job[1:])
    if job[0] == "flash":  # it refines a GPU term only: where it fails, no flash buffers
        try:
            return flash_attention_calls(*job[1:])
        except Exception as err:
            log.debug("flash attention calls not found: %s", err)
            return []
    return layer_phase_peaks(*job)


def _cost(job: tuple) -> int:
    """A measurement's relative time: a traced backward costs about three forwards."""
    return 3 if job[0] not in ("saved", "flash") and job[2] == "backward" else 1


def _on_two_cores(jobs: list[tuple]) -> list[Any]:
    """Every measurement of `jobs`, over two cores where there are two (trace_pool.py)."""
    return on_two_cores(jobs, _run, _cost)


def layer_phase_peaks(
    hf_config: dict[str, Any],
    mode: str,
    part: str,
    b: int,
    seq: int,
    precision: str,
    attn_implementation: str = "sdpa",
) -> dict[int, int]:
    """Layer index -> the traced step's phase-local peak in that layer's forward (no
    checkpointing) or backward (full checkpointing), on the rung of `mode`. The trace stops
    where the phases after it begin (the head, or the optimizer)."""
    from launcher.estimate.trace import BACKWARD_END, FORWARD_END, trace_step

    strategy, world = _TRANSIENT_RUNG[mode == "lowp"]
    ckpt, label, _ = _TRANSIENT_PHASE[part]
    traced = trace_step(hf_config, StepSpec(strategy, world, b, seq, ckpt, precision),
                        attn_implementation=attn_implementation, phase_local_peaks=True,
                        until=FORWARD_END if part == "forward" else BACKWARD_END)  # fmt: skip
    peaks: dict[int, int] = {}
    for k, v in traced.phases:
        if k.startswith(label):
            i = int(k[len(label) :])
            peaks[i] = max(peaks.get(i, 0), v)
    return peaks
