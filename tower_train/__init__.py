"""tower-train: data-parallel training with towers and gradient accumulation in TF2."""
