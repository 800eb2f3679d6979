"""Host offload of the optimizer state (ZeRO-Offload's idea on JAX memory kinds).

With ``Recipe(offload="optimizer")`` the plan gives every optimizer-state leaf its usual sharding in
``pinned_host`` memory: between steps Adam's moments (and f32 master weights, with 16-bit
parameters) live in host RAM, so device memory holds only parameters, gradients and activations.
Inside the step :func:`offload_optimizer` moves each device's shard in just for the update and
back out (XLA schedules the copies; on GPU/TPU they overlap the backward pass where the schedule
allows). The step itself is unchanged: the wrapper is the optimizer the plan hands to it.

Measured cost and memory per backend are in BENCHMARKS.md. On CPU the "device" and the host are the
same RAM, so offload changes where XLA places the arrays (the compiled program's entry layout shows
the host memory space ``S(5)``), not how much memory the process uses.
"""

from __future__ import annotations

import jax
import optax

#: JAX's memory kind for page-locked host RAM (DMA-able by GPU and TPU).
HOST_MEMORY = "pinned_host"


def to_host(shardings):
    """The same shardings placed in :data:`HOST_MEMORY`."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def offload_optimizer(inner: optax.GradientTransformation, device_shardings, host_shardings
                      ) -> optax.GradientTransformation:
    """``inner`` whose state is kept in host memory (``host_shardings``) and updated on the devices
    (``device_shardings``, the same layout in device memory). Used by the plan; the state's tree
    is ``inner``'s own, so checkpoints are the same with or without offload::

        tx = offload_optimizer(optax.adamw(1e-3), plan_device_shardings, to_host(plan_device_shardings))
    """

    def update(grads, state, params=None):
        updates, new_state = inner.update(grads, jax.device_put(state, device_shardings), params)
        return updates, jax.device_put(new_state, host_shardings)

    return optax.GradientTransformation(inner.init, update)
