"""The `stream` rung's machinery (MegaTrain's design, our own code): fp32 master weights,
gradients and AdamW state per layer in host memory (`host_state`), the layers streamed through
two device buffers (`layers`), every copy behind one small interface with a CUDA and a CPU
version (`copies`). The backend that drives them is `trainer/backends/stream.py`; docs/stream.md
says what it does and what it does not take."""
