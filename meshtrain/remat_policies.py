"""Remat policies of the layer stack, activation offload among them (one job: which ``jax.checkpoint``
policy a :class:`Remat` value means).

``Remat.OFFLOAD`` saves the named activations a model marks with
``jax.ad_checkpoint.checkpoint_name`` (:data:`ACTIVATION_NAMES`) to host memory (``pinned_host``) in the
forward pass and copies them back for the backward; every other intermediate is recomputed, as with
``full``. The recipe's ``offload_activations`` says which names (default :data:`DEFAULT_OFFLOAD`)::

    recipe = get_recipe("fsdp").with_options(remat="offload", offload_activations="mlp_hidden,attn_context")
    checkpoint_policy(Remat.OFFLOAD, ("mlp_hidden",))   # the jax.checkpoint policy the step uses

XLA:GPU and XLA:TPU run the device→host copies asynchronously next to the forward pass (the compiled
step shows them as copies into memory space ``S(5)``). XLA:CPU has one memory: JAX lowers a device→host
``device_put`` inside ``jit`` to nothing there, so on CPU ``offload`` computes exactly what it computes on
a GPU (the same saved set, the same recomputation) with the saved tensors left in the one RAM.
"""

from __future__ import annotations

import enum
from typing import Sequence, Tuple

from meshtrain.errors import RecipeError

#: The memory kind offloaded activations live in between the forward and the backward pass.
HOST_MEMORY = "pinned_host"

#: Activations the built-in decoder names (``checkpoint_name``), per layer: the attention's projected
#: queries, keys and values (before rotary embedding), its output before the output projection, and the
#: MLP's hidden activation (``silu(gate) * up``, the down projection's input).
ACTIVATION_NAMES: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attn_context", "mlp_hidden")

#: What ``remat=offload`` offloads unless the recipe says otherwise: every named activation (the layer's
#: large ones; the rest of the layer is recomputed from them and the layer input).
DEFAULT_OFFLOAD: Tuple[str, ...] = ACTIVATION_NAMES


class Remat(str, enum.Enum):
    """What the backward pass recomputes, per scanned layer.

    * ``none``: save everything (fastest, most memory);
    * ``full``: save only layer inputs, recompute the layer (least memory);
    * ``dots``: save matmul outputs, recompute the cheap element-wise work in between;
    * ``dots_no_batch``: save only matmuls without batch dims (weight matmuls, not attention scores);
    * ``offload``: copy the recipe's ``offload_activations`` (named activations, default
      :data:`DEFAULT_OFFLOAD`) to host memory (``pinned_host``) in the forward pass and back for the
      backward, recompute the rest. Device memory holds ``full``'s residuals plus one layer's offloaded
      tensors at a time; the copies use the host link (PCIe / ICI-to-host), so pick it when the activations,
      not the weights, overflow the device and the link keeps up with the layer's compute. The plan moves
      those bytes to a ``host memory`` line.
    """

    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    DOTS_NO_BATCH = "dots_no_batch"
    OFFLOAD = "offload"


#: jax.checkpoint_policies' name for each policy (looked up on use: the settings load without JAX).
_POLICIES = {
    Remat.FULL: "nothing_saveable",
    Remat.DOTS: "checkpoint_dots",
    Remat.DOTS_NO_BATCH: "dots_with_no_batch_dims_saveable",
}


def parse_offload_names(text: "str | Sequence[str]", where: str = "offload_activations") -> Tuple[str, ...]:
    """The activation names of a recipe's ``offload_activations`` (comma-separated, e.g.
    ``"mlp_hidden,attn_context"``, or a list), checked against :data:`ACTIVATION_NAMES`."""
    names = tuple(n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip())
    unknown = [n for n in names if n not in ACTIVATION_NAMES]
    if unknown or not names:
        raise RecipeError(f"{where}={text!r}: name one or more of {', '.join(ACTIVATION_NAMES)} (comma-separated)"
                          + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return names


def checkpoint_policy(remat: "Remat | str", offloaded: Sequence[str] = DEFAULT_OFFLOAD):
    """The ``jax.checkpoint`` policy of ``remat`` (``None`` for ``Remat.NONE``: no checkpoint at all);
    ``offloaded``: the names ``Remat.OFFLOAD`` sends to host memory."""
    import jax

    remat = Remat(remat)
    if remat is Remat.NONE:
        return None
    if remat is Remat.OFFLOAD:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst=HOST_MEMORY)
    return getattr(jax.checkpoint_policies, _POLICIES[remat])
