"""Activations of decoder blocks the analytic model does not know: measured from the model's own
code, or bounded when its code cannot be traced.

`launcher/estimate/peak.py` describes llama-style blocks (MODELLED_TYPES) in closed form. Any other
block is measured: the model runs one forward under FakeTensorMode (shapes and dtypes, no
storage) and a saved-tensor hook on one layer of each kind records what autograd keeps for that
layer's backward (each distinct storage once; parameters and the inputs every layer shares, such
as the mask and rotary tables, not counted: the estimate counts those once). Three runs, at
(b, s/2), (b=2, s/2) and (b, s), fit

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

import contextlib
import json
import logging
from dataclasses import replace
from typing import Any

from launcher.estimate.layer_fits import PARTS, Fit, LayerActivations
from launcher.estimate.peak import estimate
from launcher.estimate.shape import shape_of
from launcher.estimate.trace_pool import on_two_cores
from trainer.core.config import ModelConfig
from trainer.core.step_spec import StepSpec

log = logging.getLogger(__name__)

MODES = {"fp32": ("fp32",), "bf16": ("autocast", "lowp"), "fp16": ("autocast", "lowp")}


def trace_layer_activations(
    hf_config: dict[str, Any], seq_len: int, precision: str, attn_implementation: str = "sdpa"
) -> LayerActivations:
    """Measure one layer of each kind in every compute mode of `precision` (see the module doc):
    what it saves, then its transients against traced steps, on copies of the model cut to
    `reduced_depths` layers where that is exact. The forwards that count saved tensors and the
    traced steps all run at once, over two cores where there are two."""
    depths = reduced_depths(hf_config, attn_implementation)
    saved_config = at_depth(hf_config, depths[0]) if depths else hf_config
    copies = [at_depth(hf_config, d) for d in depths] if depths else [hf_config]
    s = _even(seq_len)
    saved_jobs = _saved_jobs(saved_config, precision, attn_implementation, s)
    keys, peak_jobs = _peak_jobs(copies, precision, attn_implementation, s)
    results = _on_two_cores([*saved_jobs, *peak_jobs])
    measured = _saved_fits(results[: len(saved_jobs)], precision, seq_len)
    peaks = _peaks_by_copy(keys, results[len(saved_jobs) :], len(copies))
    return _with_transients(measured, hf_config, precision, depths, peaks)


# Depths of the copies traced instead of a deep model with one kind of layer. What a layer saves
# does not depend on the depth; its transients (traced step minus the estimate's same phase) are
# linear in the layer count from 3 layers on (2 layers is a special case under FSDP: its backward
# transient is 6 KB there against 336 KB from 3 layers on, gpt_neox hidden 128, seq 256). Kinds
# that repeat with a period p (gpt-oss's sliding and full attention: p = 2) take copies p times
# as deep, so every kind keeps its share and its bottom, second and top layers.
REDUCED_DEPTHS = (3, 4)
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


def reduced_depths(hf_config: dict[str, Any], attn_implementation: str) -> tuple[int, ...]:
    """The depths of the copies traced for this model: `REDUCED_DEPTHS` times the period of
    its kinds of layer, where the model is deeper than them, its depth is whole periods and the
    copies build with exactly the first layers of the model; () to trace the whole model (a
    kind pattern that does not repeat, such as DeepSeek's first dense layers, could take
    another share in a cut copy)."""
    kinds = _kind_sequence(hf_config, attn_implementation)
    layers = len(kinds)
    periods = range(1, MAX_PERIOD + 1)
    repeats = (p for p in periods if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    period = next(repeats, None)
    if period is None or layers % period or layers <= max(REDUCED_DEPTHS) * period:
        return ()
    depths = tuple(d * period for d in REDUCED_DEPTHS)
    for depth in depths:
        try:
            cut = _kind_sequence(at_depth(hf_config, depth), attn_implementation)
        except Exception as err:  # a config whose copy does not build: trace the whole model
            log.debug("no %d-layer copy of %s: %s", depth, hf_config["model_type"], err)
            return ()
        if cut != kinds[:depth]:
            return ()
    return depths


def _kind_sequence(hf_config: dict[str, Any], attn_implementation: str) -> list[tuple]:
    """Each layer's kind (`_layer_signature`), bottom to top, from a model on the meta device."""
    from trainer.model.build import HFModelFactory, decoder_layers

    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    model = HFModelFactory(model_cfg, seed=0).build("meta")
    return _kind_of_each_layer(model, decoder_layers(model))


def saved_activations(
    hf_config: dict[str, Any], seq_len: int, precision: str, attn_implementation: str = "sdpa"
) -> LayerActivations:
    """What each part keeps for backward (layers, shared inputs, final), fitted per mode."""
    jobs = _saved_jobs(hf_config, precision, attn_implementation, _even(seq_len))
    return _saved_fits([_run(job) for job in jobs], precision, seq_len)


def calibrate_transients(
    acts: LayerActivations,
    hf_config: dict[str, Any],
    precision: str,
    attn_implementation: str,
    depths: tuple[int, ...] = (),
) -> LayerActivations:
    """`acts` with each layer's forward and backward transients: what the traced step (the
    engine's step under fake tensors, launcher/estimate/trace.py) peaks at in a layer's forward (no
    checkpointing) and backward (full checkpointing) beyond the estimate's same phase without
    them, at the three points, per mode (single for autocast and fp32, fsdp x4 for 16-bit
    parameters). With two `depths`, the traced steps are those of copies of those depths, and
    the layers' peak is extrapolated to the model's depth (`deep_peak`)."""
    copies = [at_depth(hf_config, d) for d in depths] if depths else [hf_config]
    keys, jobs = _peak_jobs(copies, precision, attn_implementation, _even(acts.seq_len))
    peaks = _peaks_by_copy(keys, _on_two_cores(jobs), len(copies))
    return _with_transients(acts, hf_config, precision, depths, peaks)


def _even(seq_len: int) -> int:
    return max(2, seq_len - seq_len % 2)


def _saved_jobs(hf_config, precision, attn_implementation, s) -> list[tuple]:
    """One forward per mode and point, counting what each layer saves (`_saved_point`)."""
    return [
        ("saved", hf_config, mode, precision, attn_implementation, b, seq)
        for mode in MODES[precision]
        for b, seq in _points(s)
    ]


def _saved_fits(results: list, precision: str, seq_len: int) -> LayerActivations:
    """The saved tensors' fits from `_saved_jobs`' results, in their order."""
    s = _even(seq_len)
    parts: dict[str, dict[str, Fit]] = {part: {} for part in PARTS}
    kinds = 1
    points_per_mode = len(_points(s))
    for k, mode in enumerate(MODES[precision]):
        mine = results[k * points_per_mode : (k + 1) * points_per_mode]
        kinds = mine[-1][1]
        for i, part in enumerate(PARTS[:3]):
            parts[part][mode] = Fit.through(*(saved[i] for saved, _ in mine), s)
    return LayerActivations("traced", parts["fits"], seq_len, num_layer_kinds=kinds,
                            shared=parts["shared"], final=parts["final"])  # fmt: skip


def _with_transients(
    acts: LayerActivations,
    hf_config: dict[str, Any],
    precision: str,
    depths: tuple[int, ...],
    by_copy: list[dict[tuple[str, str], list[dict[int, int]]]],
) -> LayerActivations:
    """`acts` with the transients fitted from the layer peaks of the traced copies (the whole
    model, or the copies `depths` deep, extrapolated)."""
    s = _even(acts.seq_len)
    shape = replace(shape_of(json.dumps(hf_config, sort_keys=True)), activations=acts)
    if depths:
        near, far = by_copy
        layers = shape.num_layers
        peaks = {
            key: [deep_peak(a, b, depths, layers) for a, b in zip(near[key], far[key], strict=True)]
            for key in near
        }
    else:
        (whole,) = by_copy
        peaks = {key: [max(p.values()) for p in points] for key, points in whole.items()}
    fits: dict[str, dict[str, Fit]] = {"backward": {}, "forward": {}}
    for (mode, part), points in peaks.items():
        strategy, world = _TRANSIENT_RUNG[mode == "lowp"]
        ckpt, _, phase = _TRANSIENT_PHASE[part]
        out = []
        for peak, (b, seq) in zip(points, _points(s), strict=True):
            spec = StepSpec(strategy, world, b, seq, ckpt, precision)
            est = estimate(shape, spec)
            out.append(peak - est.phases[phase])
        fits[part][mode] = Fit.through(*out, s)
    return replace(acts, backward=fits["backward"], forward=fits["forward"])


# (strategy, world size) the transients are traced on: single, or fsdp x4 for 16-bit weights
_TRANSIENT_RUNG = {False: ("single", 1), True: ("fsdp", 4)}
# part -> (checkpointing, the traced step's phase label, the estimate's phase)
_TRANSIENT_PHASE = {
    "backward": ("full", "backward layer ", "backward_layers"),
    "forward": ("none", "forward layer ", "forward_layers"),
}


def _points(s: int) -> tuple[tuple[int, int], ...]:
    """The (micro-batch, sequence) points every fit goes through."""
    return ((1, s // 2), (2, s // 2), (1, s))


def _peak_jobs(
    configs: list[dict[str, Any]], precision: str, attn_implementation: str, s: int
) -> tuple[list[tuple], list[tuple]]:
    """(keys, jobs): per config, mode, point and part, the `layer_phase_peaks` arguments."""
    keys = [
        (c, mode, part, point)
        for c in range(len(configs))
        for mode in MODES[precision]
        for point in _points(s)
        for part in _TRANSIENT_PHASE
    ]
    jobs = [
        (configs[c], mode, part, b, seq, precision, attn_implementation)
        for c, mode, part, (b, seq) in keys
    ]
    return keys, jobs


def _peaks_by_copy(
    keys: list[tuple], results: list[dict[int, int]], copies: int
) -> list[dict[tuple[str, str], list[dict[int, int]]]]:
    """Per config: (mode, "backward" | "forward") -> at each of `_points`, the traced step's
    peak in each layer's phase of that part (layer index -> bytes)."""
    out: list[dict[tuple[str, str], list[dict[int, int]]]] = [{} for _ in range(copies)]
    for (c, mode, part, _), peaks in zip(keys, results, strict=True):
        out[c].setdefault((mode, part), []).append(peaks)
    return out


def _run(job: tuple) -> Any:
    """One measurement: `layer_phase_peaks(*job)`, or a saved-tensor forward ("saved", ...)."""
    if job[0] == "saved":
        return _saved_point(*job[1:])
    return layer_phase_peaks(*job)


def _cost(job: tuple) -> int:
    """A measurement's relative time: a traced backward costs about three forwards."""
    return 3 if job[0] != "saved" and job[2] == "backward" else 1


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


def deep_peak(near: dict[int, int], far: dict[int, int], depths: tuple[int, ...], layers: int):
    """The largest layer peak of a `layers`-deep model from those of its copies `depths` deep
    (3p and 4p layers for kinds of layer repeating with period p, p = 1 for one kind; the peaks
    phase-local). A layer's peak is affine in how many layers lie below it and above it (what
    they saved, the gradients done), plus what only the layers at the ends do: the bottom one
    of each kind (no layer below to prefetch under FSDP, the embedding's leftovers) and the top
    one (the head's). So the bottom, second and top layers of each kind have peaks linear in
    the depth, and a kind's inner layers' largest is at its second or its second-to-last.
    Traced, every inner profile rises or falls with the index (forward rises; backward rises to
    the bottom on single and to the top on fsdp), where the second-to-last is the top one or
    below it: left out, since in a copy 3p deep it is also the second."""
    d0, d1 = depths
    period = d1 - d0

    def extrapolate(a: float, b: float) -> float:
        return a + (b - a) * (layers - d0) / (d1 - d0)

    bottom = [extrapolate(near[i], far[i]) for i in range(2 * period)]
    top = [extrapolate(near[d0 - k], far[d1 - k]) for k in range(1, period + 1)]
    return max(bottom + top)


def _saved_point(hf_config, mode, precision, attn_implementation, b, s):
    """`_saved_per_layer` with MoE experts traceable under fake tensors (`moe_fake_kernels`)."""
    from launcher.estimate.trace import moe_fake_kernels

    with moe_fake_kernels():
        return _saved_per_layer(hf_config, mode, precision, attn_implementation, b, s)


def _saved_per_layer(hf_config, mode, precision, attn_implementation, b, s):
    """((mean bytes a layer saves for backward, bytes of the inputs all layers share that they
    save, bytes saved after the last layer until the logits), kinds of layer) for a forward."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.estimate.trace import autocast_for, packed_batch
    from trainer.backends.common import COMPUTE_DTYPES
    from trainer.model.build import HFModelFactory, decoder_layers

    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    model = HFModelFactory(model_cfg, seed=0).build("meta")
    model.train()
    layers = decoder_layers(model)
    kinds = _layer_kinds(model, layers)
    counted: dict[int, int] = {}  # layer index -> bytes saved
    shared: dict[int, int] = {}  # storage -> bytes: inputs every layer reads, saved by a layer
    compute = autocast_for(precision) if mode == "autocast" else contextlib.nullcontext
    if mode == "lowp":  # FSDP's mixed precision: 16-bit parameters, no autocast
        model.to(COMPUTE_DTYPES[precision])
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        hooks = [_SavedBytes(layers[i], i, counted, shared) for i in kinds.values()]
        final = _SavedAfter(model, layers[-1])
        batch = packed_batch(hf_config["vocab_size"], b, s)
        try:
            with compute(), torch.enable_grad():
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        finally:
            for hook in [*hooks, final]:
                hook.remove()
    per_kind = {kind: counted[i] for kind, i in kinds.items()}
    members = _kind_of_each_layer(model, layers)
    total = sum(per_kind[k] for k in members)
    return (total / len(layers), sum(shared.values()), final.bytes), len(per_kind)


def _layer_signature(model, layers, i: int) -> tuple:
    layer = layers[i]
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    layer_types = getattr(text, "layer_types", None)
    kind = layer_types[i] if layer_types and i < len(layer_types) else None
    names = tuple(sorted(type(m).__name__ for m in layer.modules()))
    return (type(layer).__name__, kind, names, sum(p.numel() for p in layer.parameters()))


def _kind_of_each_layer(model, layers) -> list[tuple]:
    return [_layer_signature(model, layers, i) for i in range(len(layers))]


def _layer_kinds(model, layers) -> dict[tuple, int]:
    """One layer index per kind of layer (its class, attention type, modules, size)."""
    kinds: dict[tuple, int] = {}
    for i, signature in enumerate(_kind_of_each_layer(model, layers)):
        kinds.setdefault(signature, i)
    return kinds


class _SavedBytes:
    """Counts the distinct storages autograd saves while one layer runs forward: its input
    hidden states and what it computes, not its parameters or the inputs all layers share."""

    def __init__(self, layer, index: int, out: dict[int, int], shared: dict[int, int]):
        import torch

        self.layer, self.index, self.out, self.shared = layer, index, out, shared
        self.skip: set[int] = set()
        self.seen: set[int] = set()
        self.context = None
        self._torch = torch
        self.handles = [
            layer.register_forward_pre_hook(self._enter, with_kwargs=True),
            layer.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
        ]

    def _key(self, t) -> int:
        return t.untyped_storage()._cdata

    def _enter(self, module, args, kwargs):
        torch = self._torch
        self.skip = {self._key(p) for p in module.parameters()}
        self.skip |= {self._key(p) for p in module.buffers()}
        hidden = args[0] if args else kwargs.get("hidden_states")
        common = set()  # what the model hands every layer (mask, rotary tables)
        for value in [*args, *kwargs.values()]:
            for t in _tensors(value, torch):
                if t is not hidden:
                    common.add(self._key(t))
        self.seen, self.out[self.index] = set(), 0
        self.keep: list = []  # the storages stay alive, so their ids stay theirs

        def pack(t):
            st = t.untyped_storage()
            key = st._cdata
            if key in common:
                self.shared[key] = st.nbytes()
            elif key not in self.skip and key not in self.seen:
                self.seen.add(key)
                self.keep.append(st)
                self.out[self.index] += st.nbytes()
            return t

        self.context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.context.__enter__()

    def _exit(self, module, args, kwargs, output):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _SavedAfter:
    """Counts the distinct storages autograd saves from the end of the last layer's forward to
    the end of the model's (final norm, output head), parameters not counted."""

    def __init__(self, model, last_layer):
        import torch

        self.bytes = 0
        self.context = None
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: set[int] = set()
        keep: list = []

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params and st._cdata not in seen:
                seen.add(st._cdata)
                keep.append(st)
                self.bytes += st.nbytes()
            return t

        def start(module, args, kwargs, output):
            self.context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.context.__enter__()

        def stop(module, args, kwargs, output):
            if self.context is not None:
                self.context.__exit__(None, None, None)
                self.context = None

        self.handles = [
            last_layer.register_forward_hook(start, with_kwargs=True),
            model.register_forward_hook(stop, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tensors(value, torch) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, torch)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v, torch)]
    return []
