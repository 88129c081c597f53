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
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from launcher.estimate.layer_fits import PARTS, Fit, LayerActivations
from launcher.estimate.peak import estimate
from launcher.estimate.saved_tensors import (
    flash_attention_calls,
    kind_sequence,
    saved_point,
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
    what it saves, then its transients against traced steps, on copies of the model that keep
    a few of its layers where that is exact. The forwards that count saved tensors and the
    traced steps all run at once, over two cores where there are two. Kinds of layer of one
    size that save the same bytes are traced on the copy `copy_layers` keeps (each kind once,
    the top layer on top); kinds that differ count their saved tensors there and trace their
    steps on a copy of each kind alone (`kind_layers`), else on a copy whole periods of kinds
    deep (`period_layers`) or the whole model."""
    configured, attn_implementation = attn_implementation, traced_attention(attn_implementation)
    kinds = kind_sequence(hf_config, attn_implementation)
    layers = copy_layers(hf_config, attn_implementation, kinds)
    if layers is not None and _one_size(kinds):
        acts, per_kind = _measure(hf_config, kinds, layers, seq_len, precision, configured)
        if all(len(set(point.values())) == 1 for point in per_kind):
            return acts
        log.debug("kinds of one size saved different bytes: each kind traced alone")
    alone = kind_layers(hf_config, attn_implementation, kinds) if layers is not None else None
    if alone is None:
        layers = period_layers(hf_config, attn_implementation, kinds)
    return _measure(hf_config, kinds, layers, seq_len, precision, configured, alone)[0]


def _measure(hf_config, kinds, layers, seq_len, precision, configured, alone=None):
    """(the saved fits with their transients, what each kind saved at each point and mode),
    from the copy of the model that keeps `layers` (None: the whole model), its attention
    `configured` and traced as `traced_attention` of it. Each kind's bytes are its first
    layer's in the copy, weighted by the model's `kinds` (the copy keeps their shares, or they
    saved the same bytes), the transients the copy's traced peaks less its estimate; with
    `alone` (kind -> the layers of a copy of that kind alone), each kind's own transients
    from its copy, combined as `_combined` says."""
    config = at_layers(hf_config, layers) if layers is not None else hf_config
    s = even_seq_len(seq_len)
    attn_implementation = traced_attention(configured)
    saved_jobs = _saved_jobs(config, precision, attn_implementation, s)
    # without a mask (SDPA on one document a row, flash-attn): grouped key/value heads kept
    unmasked_jobs = (
        _saved_jobs(config, precision, attn_implementation, s, packed=False)
        if attn_implementation == "sdpa"
        else []
    )
    steps = {None: config} if alone is None else {
        kind: at_layers(hf_config, kept) for kind, kept in alone.items()
    }  # fmt: skip
    keyed = {kind: _peak_jobs(c, precision, attn_implementation, s) for kind, c in steps.items()}
    peak_jobs = [job for _, jobs in keyed.values() for job in jobs]
    flash_jobs = _flash_jobs(config, precision, configured, s)
    results = iter(_on_two_cores([*saved_jobs, *unmasked_jobs, *peak_jobs, *flash_jobs]))
    saved, unmasked, peak_results, flash = (
        [next(results) for _ in jobs] for jobs in (saved_jobs, unmasked_jobs, peak_jobs, flash_jobs)
    )
    acts = _saved_fits(saved, precision, seq_len, kinds)
    if unmasked:
        acts = replace(acts, unmasked=_saved_fits(unmasked, precision, seq_len, kinds).fits)
    acts = replace(acts, flash_calls=flash[0] if flash else [])
    peaks = iter(peak_results)
    own = {}
    for kind, (keys, jobs) in keyed.items():
        mine = _saved_fits(saved, precision, seq_len, kinds if kind is None else [kind])
        traced = _peaks(keys, [next(peaks) for _ in jobs])
        own[kind] = (mine, _transients(mine, steps[kind], precision, traced))
    transients = own[None][1] if alone is None else _combined(acts, own)
    return replace(acts, **transients), [r[0] for r in saved]


def _combined(acts: LayerActivations, own: dict) -> dict[str, dict[str, Fit]]:
    """The transients of the estimate's mean layer (`acts`) from each kind's own (kind -> its
    saved fits and transients, each traced on a copy of that kind alone): room for the kind
    whose saved bytes and transient together are the largest, less the mean layer's saved
    bytes, at each point. The layers below the top one hold what the mean layer says."""
    s = even_seq_len(acts.seq_len)
    out: dict[str, dict[str, Fit]] = {"backward": {}, "forward": {}}
    for part, fits in out.items():
        for mode, mean in acts.fits.items():
            at = [
                max(m.fits[mode].bytes(b, q) + t[part][mode].bytes(b, q) for m, t in own.values())
                - mean.bytes(b, q)
                for b, q in points(s)
            ]
            fits[mode] = Fit.through(*at, s)
    return out


# The copies traced instead of a deep model. What a layer saves does not depend on the depth, and
# nor do its transients (the traced step's largest layer peak less the estimate's same phase for
# the same copy) from 3 layers on, but for the allocator's rounding of a layer's small tensors:
# 24 B to 8 KB a layer in bench.models_trace's nine types (copies of 3, 4 and 8 layers), 0.03 MiB
# for gpt-oss-20b's shape, 0 for Qwen3-235B-A22B's. 2 layers is a special case under FSDP: its
# backward transient is 6 KB there against 336 KB from 3 layers on (gpt_neox hidden 128, seq
# 256). Kinds of layer of one size that save the same bytes (sliding and full attention over the
# same modules: gpt-oss, gemma3's one full layer in six) are copied with the first layer of each
# kind and the top layer: the model's shares of kinds do not matter there. Kinds that differ
# (Qwen3-Next's linear and full attention, dense and MoE layers) would fit the estimate's one
# transient over a mean layer to that copy's mean (-9% to -18% of the traced peak for a 12-layer
# Qwen3-Next under full checkpointing): each is traced alone instead, and the mean layer's
# transient makes room for the largest (`_combined`; -0.6% to +3.6% there, the whole model's own
# trace -0.7% to +3.5%).
REDUCED_DEPTH = 3
MAX_PERIOD = 4  # kinds that differ, repeat and cannot be copied alone: a copy 3p deep
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _depth_key(hf_config: dict[str, Any]) -> str:
    """The config key that holds the layer count, as the HF config class spells it (its
    `attribute_map` sends `num_hidden_layers` to e.g. GPT-2's `n_layer`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[hf_config["model_type"]]
    mapped = getattr(cls, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    return next((k for k in (mapped, *_DEPTH_KEYS) if k in hf_config), mapped)


def at_layers(hf_config: dict[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """A copy of the config that keeps `layers` of the model (indices, bottom to top; one may
    repeat): per-layer lists (`layer_types`, any list as long as the model is deep) keep those
    layers' entries, lists of layer indices (`mlp_only_layers`, `moe_layers`) and
    `first_k_dense_replace` (the first k layers dense) are renumbered to the kept ones."""
    depth = shape_of(json.dumps(hf_config, sort_keys=True)).num_layers
    out = {
        k: [v[i] for i in layers] if isinstance(v, list) and len(v) == depth else v
        for k, v in hf_config.items()
    }
    for key in _INDEX_LISTS:
        if isinstance(out.get(key), list) and len(out[key]) != depth:
            listed = set(hf_config[key])
            out[key] = [j for j, i in enumerate(layers) if i in listed]
    if isinstance(out.get("first_k_dense_replace"), int):
        out["first_k_dense_replace"] = sum(i < hf_config["first_k_dense_replace"] for i in layers)
    out[_depth_key(hf_config)] = len(layers)
    return out


_INDEX_LISTS = ("mlp_only_layers", "moe_layers")  # layer indices, not one entry per layer


def copy_layers(
    hf_config: dict[str, Any], attn_implementation: str, kinds: list[tuple] | None = None
) -> list[int] | None:
    """The layers of the model its traced copy keeps, or None to trace the whole model: at least
    REDUCED_DEPTH, every kind of layer, the top layer's kind on top. The shortest of the first
    layers that does (a kind that does not repeat, such as DeepSeek's first dense layers, keeps
    its place), or the first layer of each kind, the top layer and the first others up to
    REDUCED_DEPTH (gemma3's one full-attention layer in six); whichever is shorter and builds
    with exactly those layers' kinds (a key other than a per-layer list, such as
    `first_k_dense_replace`, keeps the first layers only)."""
    kinds = kinds or kind_sequence(hf_config, attn_implementation)
    depth = len(kinds)
    prefix = next(
        (
            list(range(d))
            for d in range(REDUCED_DEPTH, depth)
            if set(kinds[:d]) == set(kinds) and kinds[d - 1] == kinds[-1]
        ),
        None,
    )
    picked = {kinds.index(kind) for kind in set(kinds)} | {depth - 1}
    picked |= set(sorted(set(range(depth)) - picked)[: max(0, REDUCED_DEPTH - len(picked))])
    candidates = [c for c in (prefix, sorted(picked)) if c is not None and len(c) < depth]
    for layers in sorted(candidates, key=len):  # the first layers where as short
        if _builds(hf_config, attn_implementation, kinds, layers):
            return layers
    return None


def period_layers(
    hf_config: dict[str, Any], attn_implementation: str, kinds: list[tuple]
) -> list[int] | None:
    """The first REDUCED_DEPTH periods of layers where the kinds repeat with a period of up to
    MAX_PERIOD from the first layer, the model is whole periods deep and the copy builds with
    exactly those layers' kinds, so that every kind keeps its share; None (the whole model)
    otherwise (DeepSeek's first dense layers, a longer pattern)."""
    depth = len(kinds)
    periods = range(1, MAX_PERIOD + 1)
    period = next((p for p in periods if all(k == kinds[i % p] for i, k in enumerate(kinds))), 0)
    if not period or depth % period or depth <= REDUCED_DEPTH * period:
        return None
    layers = list(range(REDUCED_DEPTH * period))
    return layers if _builds(hf_config, attn_implementation, kinds, layers) else None


def kind_layers(
    hf_config: dict[str, Any], attn_implementation: str, kinds: list[tuple]
) -> dict[tuple, list[int]] | None:
    """For each kind of layer, REDUCED_DEPTH layers of that kind alone (its last ones, one
    repeated where the model has fewer), whose copy builds with exactly that kind; None where
    one does not (a kind decided by a key `at_layers` cannot renumber)."""
    out = {}
    for kind in dict.fromkeys(kinds):
        mine = [i for i, k in enumerate(kinds) if k == kind]
        layers = sorted((mine * REDUCED_DEPTH)[-REDUCED_DEPTH:])
        if not _builds(hf_config, attn_implementation, kinds, layers):
            return None
        out[kind] = layers
    return out


def _builds(hf_config, attn_implementation, kinds, layers) -> bool:
    """Whether the copy of the model that keeps `layers` builds with exactly their kinds."""
    try:
        copy = kind_sequence(at_layers(hf_config, layers), attn_implementation)
    except Exception as err:  # a config whose copy does not build: trace the whole model
        log.debug("no copy of %s's layers %s: %s", hf_config["model_type"], layers, err)
        return False
    return copy == [kinds[i] for i in layers]


def _one_size(kinds: list[tuple]) -> bool:
    """Whether every kind of layer has as many parameters (a kind's last field)."""
    return len({kind[-1] for kind in kinds}) == 1


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
    layers: Sequence[int] | None = None,
) -> LayerActivations:
    """The saved fits with each layer's forward and backward transients: what the traced step
    (the engine's step under fake tensors, launcher/estimate/trace.py) peaks at in a layer's
    forward (no checkpointing) and backward (full checkpointing) beyond the estimate's same
    phase without them, at the three points, per mode (single for autocast and fp32, fsdp x4
    for 16-bit parameters), on the whole model or its copy that keeps `layers`."""
    kinds = kind_sequence(hf_config, traced_attention(attn_implementation))
    layers = None if layers is None else list(layers)
    return _measure(hf_config, kinds, layers, seq_len, precision, attn_implementation)[0]


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


def _transients(
    acts: LayerActivations,
    hf_config: dict[str, Any],
    precision: str,
    peaks: dict[tuple[str, str], list[dict[int, int]]],
) -> dict[str, dict[str, Fit]]:
    """The backward and forward transients fitted from the layer peaks traced on `hf_config`
    (the whole model or its copy): the largest layer peak less the estimate of the same phase
    for the same layers with the saved fits `acts`, without transients, at each point."""
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
    return fits


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
