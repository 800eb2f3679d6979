"""Parallel kernels: attention kinds (dense; context-parallel kinds), mixture of experts, pipeline."""

from meshtrain.parallel.attention import attention

__all__ = ["attention"]
