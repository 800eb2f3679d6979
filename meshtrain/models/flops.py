"""FLOPs of a decoder: the model FLOPs that MFU counts, and the FLOPs a step really executes.

MFU (model FLOPs utilisation) counts useful work only::

    model_flops_per_token(cfg, T) = 6·N + 6·L·n·h·T

* ``N``: parameters that take part in matmuls (mixture of experts: those a token is routed
  through, i.e. *active* parameters; MFU by active FLOPs), i.e. all parameters except a separate input
  embedding table (a lookup, not a matmul); norm scales are included (negligible).
  ``6·N``: forward ``2·N`` (multiply + add per weight) and backward ``4·N`` (input and weight grads).
* ``6·L·n·h·T``: attention scores ``Q·Kᵀ`` and ``P·V`` (``2·2·n·h·T`` per token per layer in the
  forward, ×3 with the backward) with causal masking counted once: each query attends to ``T/2``
  keys on average, so half of the full ``12·L·n·h·T``. ``L`` layers, ``n`` query heads of width
  ``h``, sequence length ``T``.

``MFU = model_flops_per_token · tokens per step / (step time · devices · peak FLOP/s)``.

The FLOPs a step *executes* (:func:`step_flops`) differ: dense attention computes the whole
``T×T`` square (masked, not skipped), and rematerialisation re-runs (parts of) the forward.

Example::

    cfg = get_config("llama3-70b")
    model_flops_per_token(cfg, 8192) / 1e12      # ≈ 0.44 TFLOP per token
"""

from __future__ import annotations

import dataclasses
import math

from jax.extend import core as jcore

from meshtrain.recipes import Remat
from meshtrain.remat_policies import DEFAULT_OFFLOAD


def matmul_params(cfg) -> int:
    """``N`` in ``6·N``: all parameters minus a separate (untied) input embedding table. For a
    mixture-of-experts decoder, the *active* parameters (router, ``experts_per_token`` routed and the
    shared experts per token): MFU of an MoE model is by active FLOPs."""
    embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    active = getattr(cfg, "num_active_params", None)
    return (active() if active is not None else cfg.num_params()) - embed


def attention_flops_per_token(cfg, seq_len: int, *, causal_once: bool = True) -> float:
    """Forward + backward FLOPs of ``Q·Kᵀ`` and ``P·V`` per token: ``12·L·n·h·T`` (full square) or
    half of it with causal masking counted once."""
    full = 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return full / 2 if causal_once else full


def model_flops_per_token(cfg, seq_len: int) -> float:
    """``6·N + 6·L·n·h·T``: the MFU numerator per token (see the module docstring)."""
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal_once=True)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step over the whole batch (all devices together).

    ``model``: what MFU counts; ``executed``: what the hardware runs (dense attention square,
    recomputation), ``recompute``: the part of ``executed`` spent re-running the forward.
    """

    model: float
    executed: float
    recompute: float

    @property
    def executed_forward(self) -> float:
        """The backward's share is ``2 ×`` the forward; ``executed = 3·forward + recompute``."""
        return (self.executed - self.recompute) / 3


def _offloaded_producer_flops(cfg, seq_len: int, offloaded) -> float:
    """Forward FLOPs per token of the matmuls whose outputs ``remat=offload`` brings back instead of recomputing:
    the q/k/v projections and attention's ``P·V`` (its context); the MLP's hidden activation still needs its
    gate and up projections recomputed (their outputs are what its backward reads)."""
    L, n, kv, h, d = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    per_name = {"q_proj": 2.0 * L * d * n * h, "k_proj": 2.0 * L * d * kv * h, "v_proj": 2.0 * L * d * kv * h,
                "attn_context": attention_flops_per_token(cfg, seq_len, causal_once=False) / 6}
    return sum(per_name.get(name, 0.0) for name in offloaded)


def step_flops(cfg, batch_size: int, seq_len: int, remat: "Remat | str" = Remat.NONE,
               offloaded=DEFAULT_OFFLOAD) -> StepFlops:
    """Model and executed FLOPs of one step on ``batch_size × seq_len`` tokens.

    Executed: forward ``2·N + 4·L·n·h·T`` per token (dense attention: full square), backward twice
    that, plus recomputation: ``full`` re-runs the whole forward, ``offload`` the forward less the matmuls
    whose outputs come back from host memory (``offloaded`` names: q/k/v projections, attention's ``P·V``),
    ``dots_no_batch`` re-runs the attention matmuls (they have a batch dimension so are not saved), ``dots``
    and ``none`` re-run no matmul.
    """
    remat = Remat(remat)
    tokens = batch_size * seq_len
    fwd = 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal_once=False) / 3
    recompute = {Remat.NONE: 0.0, Remat.DOTS: 0.0, Remat.FULL: fwd,
                 Remat.OFFLOAD: fwd - _offloaded_producer_flops(cfg, seq_len, offloaded),
                 Remat.DOTS_NO_BATCH: attention_flops_per_token(cfg, seq_len, causal_once=False) / 3}[remat]
    return StepFlops(model_flops_per_token(cfg, seq_len) * tokens, (3 * fwd + recompute) * tokens,
                     recompute * tokens)


# -- FLOPs of any program -----------------------------------------------------------------------

def _sub_jaxprs(params) -> list:
    out = []
    for value in params.values():
        for x in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def jaxpr_flops(jaxpr) -> float:
    """Matmul and convolution FLOPs of a (closed) jaxpr: ``2·M·N·K`` per ``dot_general``, convolutions
    likewise, ``scan`` bodies × their length, ``shard_map`` bodies × the devices they run on, the
    larger branch of a ``cond``. (XLA's ``cost_analysis`` counts a loop body once.)"""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) / max(out_features, 1)
        subs = _sub_jaxprs(eqn.params)
        if not subs:
            continue
        if name == "cond":
            total += max(jaxpr_flops(s) for s in subs)
            continue
        factor = 1
        if name == "scan":
            factor = int(eqn.params.get("length", 1))
        elif name == "shard_map":
            mesh = eqn.params.get("mesh")
            manual = eqn.params.get("manual_axes") or (tuple(mesh.axis_names) if mesh is not None else ())
            factor = math.prod(dict(mesh.shape)[a] for a in manual) if mesh is not None else 1
        total += factor * sum(jaxpr_flops(s) for s in subs)
    return total
