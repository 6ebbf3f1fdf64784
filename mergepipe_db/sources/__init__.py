"""Expert sources: how each kind of expert (full, delta, LoRA, packed) is scanned, costed and read."""
