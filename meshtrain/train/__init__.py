"""Training: state (sharded init), step, trainer, metrics."""
