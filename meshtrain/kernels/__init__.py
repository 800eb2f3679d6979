"""Hand-written kernels XLA does not emit, each behind a decision of :func:`meshtrain.parallel.resolved.resolve_step`
(a kernel runs only where the resolved step says so; everything else is XLA's)."""
