"""The exact-math memory levers on a built model: chunked loss, activation offload, tiled MLP,
Ulysses sequence parallelism."""
