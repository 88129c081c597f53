"""Activation offload: what decoder layers save for backward lives in host memory in between.

`ActivationOffload.layer(i)` is a `saved_tensors_hooks` context around one decoder layer's
forward (the checkpoint wrapper of `trainer.model.build` enters it). Every tensor autograd saves in
it (under `full` checkpointing only the layer's inputs: the recomputation saves the rest in
backward) is copied to host memory and brought back when backward unpacks it. Parameters are
left where they are (they stay on the device anyway), and so are tiny tensors.

On CUDA the copies out run on a side stream into pinned buffers, overlapped with the next
operations; a device tensor is released once its copy is done, and at most
`max_in_flight_bytes` of them, of the last `OFFLOAD_LAYERS_IN_FLIGHT` layers, wait for their
copy (a layer's end waits for the copies of the layers before those). In backward, the first
unpack of a layer's tensors brings that layer's and the next layer's (the one backward reaches
next) back on a second side stream, so copies in overlap the layer's backward. On CPU processes
the same code path runs with plain copies, so the math and the byte counts are tested without a
GPU.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from trainer.core.step_spec import OFFLOAD_LAYERS_IN_FLIGHT, OFFLOAD_MAX_IN_FLIGHT_BYTES

MIN_OFFLOAD_BYTES = 1024
_PLAIN_TENSORS = (torch.Tensor, FakeTensor)  # FakeTensor: the estimator's trace


@dataclass
class _Saved:
    """A saved tensor in host memory; `device_copy` once backward brought it back."""

    host: torch.Tensor
    device: torch.device
    layer: int
    device_copy: torch.Tensor | None = None
    ready: torch.cuda.Event | None = field(default=None, repr=False)


def _indexed(device: torch.device) -> torch.device:
    """`cuda` with its index: tensors name theirs, and `cuda` != `cuda:0` (without it nothing
    matched on a GPU and nothing was offloaded)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ActivationOffload:
    def __init__(
        self,
        device: torch.device,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        max_in_flight_bytes: int = OFFLOAD_MAX_IN_FLIGHT_BYTES,
        host: torch.device | None = None,
    ):
        """`host`: where copies go on a CPU device (the trace keeps them on `meta`, so that its
        CPU stand-in for the device does not count them)."""
        self.device = _indexed(device)
        self.host = host or torch.device("cpu")
        self.min_bytes = min_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.cuda = device.type == "cuda"
        self._out_stream = torch.cuda.Stream(device) if self.cuda else None
        self._in_stream = torch.cuda.Stream(device) if self.cuda else None
        # copies out not known to be done: (event, the device tensor it reads, bytes, layer)
        self._in_flight: collections.deque[tuple[torch.cuda.Event, torch.Tensor, int, int]] = (
            collections.deque()
        )
        self._in_flight_bytes = 0
        self._by_layer: dict[int, list[_Saved]] = collections.defaultdict(list)
        self.offloaded_bytes = 0  # bytes copied to the host
        self.restored_bytes = 0  # bytes copied back for backward

    def reset_counts(self) -> None:
        self.offloaded_bytes = self.restored_bytes = 0

    def drop(self) -> None:
        """Forget a forward whose backward will not run (an aborted step): its host copies,
        the copies in flight, and the counts."""
        if self.cuda:
            self._retire(wait=True)
        self._by_layer.clear()
        self.reset_counts()

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Offload what autograd saves inside this context: decoder layer `index`'s forward."""
        if index == 0:  # a new forward: what an abandoned one left is no longer needed
            self._by_layer.clear()
        # One host copy per tensor saved more than once. The entry holds the tensor too, until
        # the layer's end: freed earlier, its memory could come back as a new tensor that
        # matches the key.
        seen: dict[tuple, tuple[torch.Tensor, _Saved]] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor | _Saved:
            if not self._offloadable(tensor):
                return tensor
            key = (
                tensor.untyped_storage()._cdata,  # the storage itself (fake ones have no data)
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
                tensor._version,
            )
            if key not in seen:
                seen[key] = (tensor, self._copy_out(tensor, index))
            return seen[key][1]

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            # every saved tensor's hook object keeps `pack`, and so `seen`, alive until backward
            seen.clear()
        self._retire(wait=False, through_layer=index - OFFLOAD_LAYERS_IN_FLIGHT)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (
            not isinstance(tensor, nn.Parameter)
            and not isinstance(tensor._base, nn.Parameter)  # a weight's transpose for a matmul
            and tensor.device == self.device
            and tensor.layout == torch.strided
            and type(tensor) in _PLAIN_TENSORS  # not DTensor, NF4 or other subclasses
            and tensor.numel() * tensor.element_size() >= self.min_bytes
        )

    def _copy_out(self, tensor: torch.Tensor, layer: int) -> _Saved:
        num_bytes = tensor.numel() * tensor.element_size()
        self.offloaded_bytes += num_bytes
        if not self.cuda:
            saved = _Saved(tensor.detach().to(self.host, copy=True), tensor.device, layer)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._out_stream):
                host.copy_(tensor, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            # the device tensor may be freed only after its copy: hold it until then
            self._in_flight.append((done, tensor, num_bytes, layer))
            self._in_flight_bytes += num_bytes
            self._retire(wait=False)
            saved = _Saved(host, tensor.device, layer)
        self._by_layer[layer].append(saved)
        return saved

    def _retire(self, wait: bool, through_layer: int = -1) -> None:
        """Release device tensors whose copy out is done (all of them with `wait`); waits for
        the oldest while more than `max_in_flight_bytes` are pending, and for the copies of
        layers up to `through_layer`."""
        while self._in_flight:
            done, _, num_bytes, layer = self._in_flight[0]
            over = self._in_flight_bytes > self.max_in_flight_bytes
            if not (wait or over or layer <= through_layer or done.query()):
                break
            done.synchronize()
            self._in_flight.popleft()
            self._in_flight_bytes -= num_bytes

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        # The first unpack of a layer brings back what is still on the host of it and of the
        # next layer backward reaches (overlapped with this one's backward). A layer that was
        # itself prefetched still starts its successor's copies here, so the chain goes on.
        if saved.layer in self._by_layer or saved.layer - 1 in self._by_layer:
            if self.cuda:
                self._retire(wait=True)  # backward started: every copy out is needed now
            self._bring_back(saved.layer)
            self._bring_back(saved.layer - 1)
        if saved.device_copy is None:  # a tensor packed after its layer was brought back
            self._bring_back_one(saved)
        tensor = saved.device_copy
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            tensor.record_stream(current)
        return tensor

    def _bring_back(self, layer: int) -> None:
        for saved in self._by_layer.pop(layer, ()):
            if saved.device_copy is None:
                self._bring_back_one(saved)

    def _bring_back_one(self, saved: _Saved) -> None:
        self.restored_bytes += saved.host.numel() * saved.host.element_size()
        if not self.cuda:
            saved.device_copy = saved.host.to(saved.device, copy=True)
            return
        with torch.cuda.stream(self._in_stream):
            saved.device_copy = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record()
