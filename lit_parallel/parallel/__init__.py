"""Pure PyTorch building blocks (no Lightning import): usable without a Trainer."""
