"""How much memory a training step takes: the model's shape, its states, its activations, the
peak."""
