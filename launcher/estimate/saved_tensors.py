"""What each decoder layer of a model keeps for its backward, counted from one forward under fake
tensors, and the kinds of layer a model has (`launcher/estimate/traced_activations.py` fits and
calibrates the estimate from these)."""

from __future__ import annotations

import contextlib
from typing import Any

from trainer.core.config import ModelConfig


def kind_sequence(hf_config: dict[str, Any], attn_implementation: str) -> list[tuple]:
    """Each layer's kind (`_layer_signature`), bottom to top, from a model on the meta device."""
    from trainer.model.build import HFModelFactory, decoder_layers

    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    model = HFModelFactory(model_cfg, seed=0).build("meta")
    return _kind_of_each_layer(model, decoder_layers(model))


def saved_point(hf_config, mode, precision, attn_implementation, b, s, compiled=False,
                packed=True):  # fmt: skip
    """`_saved_per_layer` with MoE experts traceable under fake tensors (`moe_fake_kernels`);
    `packed=False`: each row one document, its mask decided as for the real input (none for
    causal attention: SDPA takes grouped key/value heads as they are instead of repeated)."""
    from launcher.estimate.trace_patches import moe_fake_kernels

    masks = contextlib.nullcontext() if packed else _masks_as_for_real()
    with moe_fake_kernels(), masks:
        return _saved_per_layer(hf_config, mode, precision, attn_implementation, b, s, compiled,
                                packed)  # fmt: skip


def _saved_per_layer(hf_config, mode, precision, attn_implementation, b, s, compiled, packed):
    """(kind of layer -> bytes one layer of that kind saves for backward, bytes of the inputs all
    layers share that they save, bytes saved after the last layer until the logits) for a
    forward of packed windows, or of one document a row; `compiled`: the counted layers'
    forward torch.compiled with inductor's partition (`aot_eager_decomp_partition`: its
    decompositions and min-cut partitioner, no kernels), as `train.compile` runs them."""
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
        if compiled:
            torch._dynamo.reset()  # each measurement compiles its own layers afresh
            for i in kinds.values():
                layers[i].forward = torch.compile(
                    layers[i].forward, backend="aot_eager_decomp_partition", dynamic=False
                )
        hooks = [_SavedBytes(layers[i], i, counted, shared) for i in kinds.values()]
        final = _SavedAfter(model, layers[-1])
        batch = packed_batch(hf_config["vocab_size"], b, s)
        positions = batch["position_ids"] if packed else torch.arange(s).repeat(b, 1)
        try:
            with compute(), torch.enable_grad():
                model(input_ids=batch["input_ids"], position_ids=positions)
        finally:
            for hook in [*hooks, final]:
                hook.remove()
    return {kind: counted[i] for kind, i in kinds.items()}, sum(shared.values()), final.bytes


# The largest head size PyTorch's flash kernel takes on the GPUs oomless plans for (sm80 on)
FLASH_MAX_HEAD_DIM = 256
# flash-attn's kernels run on a GPU with the package only; PyTorch's SDPA saves what they save
# for backward (queries, keys, values, the output, the log-sum-exp), so a block configured with
# them is traced under `sdpa`, which stands in for them
TRACED_AS = {"flash_attention_2": "sdpa", "flash_attention_3": "sdpa"}


def traced_attention(attn_implementation: str) -> str:
    """The attention implementation a block configured with `attn_implementation` is traced
    under (TRACED_AS)."""
    return TRACED_AS.get(attn_implementation, attn_implementation)


def flash_attention_calls(hf_config, precision, attn_implementation, s) -> list[list[int]]:
    """The attention calls of one unpacked forward in 16 bits that a flash kernel would take on
    a GPU: under `sdpa`, PyTorch's, `scaled_dot_product_attention` without a mask, over
    queries, keys and values of one head size up to FLASH_MAX_HEAD_DIM; under flash-attn
    (TRACED_AS), every such call with or without a mask (its kernels take sliding windows and
    packed documents themselves). Each as [query heads, key/value heads, head size], once.
    Under `sdpa`, sliding windows the sequence outruns, attention biases and masked layers call
    it with a mask; sinks and soft-capping do not call it at all."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    from launcher.estimate.trace_patches import moe_fake_kernels
    from trainer.backends.common import COMPUTE_DTYPES
    from trainer.model.build import HFModelFactory

    any_mask = attn_implementation in TRACED_AS
    attn_implementation = traced_attention(attn_implementation)
    model_cfg = ModelConfig(config=dict(hf_config), attn_implementation=attn_implementation)
    model = HFModelFactory(model_cfg, seed=0).build("meta")
    model.to(COMPUTE_DTYPES[precision])
    calls: set[tuple[int, int, int]] = set()

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                sizes = {q.shape[-1], k.shape[-1], v.shape[-1]}
                unmasked = mask is None or any_mask
                if unmasked and len(sizes) == 1 and q.shape[-1] <= FLASH_MAX_HEAD_DIM:
                    calls.add((q.shape[-3], k.shape[-3], q.shape[-1]))
            return func(*args, **kwargs)

    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        moe_fake_kernels(),
        _masks_as_for_real(),
        _grouped_query_kept() if any_mask else contextlib.nullcontext(),
    ):
        model.to_empty(device="cpu")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        with Watch(), torch.no_grad():
            model(input_ids=torch.zeros(1, s, dtype=torch.long), use_cache=False)
    return [list(call) for call in sorted(calls)]


def _masks_as_for_real():
    """transformers' mask builders decide as for the real, unpadded and unpacked input: they
    build a mask whenever an input is a fake tensor, whose values they cannot read (to find
    padding, or documents packed by position ids), where for the real input they leave causal
    attention to SDPA's flag."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    from launcher.estimate.trace_patches import patched

    return patched(
        masking_utils,
        is_tracing=lambda tensor=None: import_utils.is_tracing(),
        find_packed_sequence_indices=lambda position_ids: None,  # one document
    )


def _grouped_query_kept():
    """transformers' SDPA path hands SDPA its key/value heads ungrouped even with a mask, as its
    flash-attn path does with any (where SDPA's kernels take no mask, it repeats them first)."""
    from transformers.integrations import sdpa_attention

    from launcher.estimate.trace_patches import patched

    return patched(sdpa_attention, use_gqa_in_sdpa=lambda *args, **kwargs: True)


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
