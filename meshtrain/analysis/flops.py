"""FLOPs of a decoder: the model FLOPs that MFU counts, and the FLOPs a step really executes.

MFU (model FLOPs utilisation) counts useful work only::

    model_flops_per_token(cfg, T) = 6·N + 6·L·n·h·T

* ``N``: parameters that take part in matmuls, i.e. all parameters except a separate input
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

from meshtrain.recipes import Remat


def matmul_params(cfg) -> int:
    """``N`` in ``6·N``: all parameters minus a separate (untied) input embedding table."""
    embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.num_params() - embed


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


def step_flops(cfg, batch_size: int, seq_len: int, remat: "Remat | str" = Remat.NONE) -> StepFlops:
    """Model and executed FLOPs of one step on ``batch_size × seq_len`` tokens.

    Executed: forward ``2·N + 4·L·n·h·T`` per token (dense attention: full square), backward twice
    that, plus recomputation: ``full`` re-runs the whole forward, ``dots_no_batch`` re-runs the
    attention matmuls (they have a batch dimension so are not saved), ``dots`` and ``none`` re-run
    no matmul.
    """
    remat = Remat(remat)
    tokens = batch_size * seq_len
    fwd = 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal_once=False) / 3
    recompute = {Remat.NONE: 0.0, Remat.DOTS: 0.0, Remat.FULL: fwd,
                 Remat.DOTS_NO_BATCH: attention_flops_per_token(cfg, seq_len, causal_once=False) / 3}[remat]
    return StepFlops(model_flops_per_token(cfg, seq_len) * tokens, (3 * fwd + recompute) * tokens,
                     recompute * tokens)
