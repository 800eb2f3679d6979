"""Mixture-of-experts figures of a plan: parameters (total and active), expert-weight memory per
device, the token exchange (all-to-all bytes per step per layer) and how it is done.

Example::

    moe_summary(plan, get_config("mixtral-8x7b"), "tpu")
    # {'experts': 8, 'top_k': 2, 'ep': 8, 'exchange': 'capacity (padded fixed-size all-to-all)',
    #  'expert_bytes_per_device': ..., 'all_to_all_bytes_per_layer_step': ..., ...}

:func:`moe_terms` gives the memory and step-time estimates their MoE terms (expert rows per token,
buffers, gathered expert weights, capacity padding); see :class:`MoETerms`.

Formulas: expert-weight bytes per device = Σ over expert leaves of the plan's bytes per device
(``total / ep`` when only ``expert`` splits them; FSDP/TP divide further); all-to-all bytes in
:func:`meshtrain.analysis.comms.moe_exchange_bytes`; MFU counts *active* FLOPs
(:func:`meshtrain.models.flops.matmul_params`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import numpy as np

from meshtrain.analysis.comms import Backend, batch_dims, expert_axes, expert_exchange, moe_exchange_bytes
from meshtrain.analysis.exchange import dcn_per_op
from meshtrain.analysis.layout import cached, layout_of
from meshtrain.parallel.moe import capacity_for
from meshtrain.plan import fmt_bytes
from meshtrain.strategies import AllToAll


def moe_summary(plan, cfg, backend: "Backend | str" = Backend.CPU) -> Optional[Dict[str, object]]:
    """The MoE figures of ``plan`` for decoder ``cfg`` (``None`` for a dense model or another model)."""
    if not getattr(cfg, "n_experts", 0):
        return None
    leaves = [l for l in plan.group("params") if "expert" in (l.logical_axes or ())]
    x = moe_exchange_bytes(plan, cfg, backend) if plan.batch is not None else None
    return {
        "experts": cfg.n_experts, "top_k": cfg.experts_per_token, "shared_experts": cfg.n_shared_experts,
        "d_expert": cfg.d_expert or cfg.d_ff,
        "dispatch": "dropless" if cfg.capacity_factor is None else f"capacity factor {cfg.capacity_factor}",
        "params": cfg.num_params(), "active_params": cfg.num_active_params(),
        "mfu_basis": "active parameters (6·N_active + attention)",
        "expert_axes": list(expert_axes(plan)), "ep": x["ep"] if x else None,
        "expert_bytes_total": sum(l.bytes_total for l in leaves),
        "expert_bytes_per_device": sum(l.bytes_per_device for l in leaves),
        "exchange": x["exchange"] if x and x["ep"] > 1 else "none (experts not split over devices)",
        "all_to_all_bytes_per_op": x["per_op"] if x and x["ep"] > 1 else 0.0,
        "all_to_all_bytes_per_layer_step": x["per_layer_step"] if x and x["ep"] > 1 else 0.0,
        "dcn": exchange_dcn(plan, cfg, backend) if x and x["ep"] > 1 else None,
    }


def exchange_dcn(plan, cfg, backend: "Backend | str" = Backend.CPU) -> Optional[Dict[str, object]]:
    """What the token exchange sends across DCN per layer per step, one device, for the plan's form and for the
    other (:func:`meshtrain.analysis.exchange.dcn_per_op` × the exchange's all-to-alls per layer and step), and the
    factors flat / hierarchical: ``bytes_factor`` = tensor ranks (PCC; 1 without tensor parallelism), for the same
    buffer, ``messages_factor`` = expert devices per slice. ``None`` when the expert axes stay inside one slice.
    Dropless on GPU/TPU: flat is ragged (the rows that exist), hierarchical padded (``ep ×`` the local
    assignments), so there the factor can fall below 1."""
    ex = expert_exchange(plan)
    if ex.slices <= 1 or not ex.expert_axes:
        return None
    x = moe_exchange_bytes(plan, cfg, backend)
    ops, t = x["ops_per_layer_step"], layout_of(plan).tensor
    own = x["per_op"]
    if cfg.capacity_factor is None and Backend(backend) is not Backend.CPU:  # flat ragged, hierarchical padded
        padded = own if ex.hierarchical else own * ex.ep
        per_op = {AllToAll.HIERARCHICAL: padded, AllToAll.FLAT: padded / ex.ep}
    else:
        per_op = {AllToAll.HIERARCHICAL: own, AllToAll.FLAT: own}
    forms = {}
    for kind in AllToAll:
        one = dcn_per_op(dataclasses.replace(ex, kind=kind), per_op[kind], t)
        forms[kind.value] = {"bytes": one["bytes"] * ops, "messages": one["messages"] * ops}
    flat, hier = forms["flat"], forms["hierarchical"]
    return {"all_to_all": ex.kind.value, "slices": ex.slices, "per_slice": ex.per_slice, "tensor": t, **forms,
            "bytes_factor": flat["bytes"] / hier["bytes"] if hier["bytes"] else None,
            "messages_factor": flat["messages"] / hier["messages"] if hier["messages"] else None}


def moe_lines(summary: Optional[Dict[str, object]]) -> list:
    """Report lines for :func:`moe_summary` (empty for a dense model)."""
    if not summary:
        return []
    gib = lambda n: fmt_bytes(n, ".3f", "GiB") if n >= 2 ** 26 else fmt_bytes(n, ",.1f", "KiB")  # noqa: E731
    s = summary
    return ["", f"mixture of experts: {s['experts']} experts, top-{s['top_k']}, {s['shared_experts']} shared, "
                f"{s['dispatch']}; {s['params']:,} parameters, {s['active_params']:,} active per token "
                f"(MFU by {s['mfu_basis']})",
            f"  expert weights: {gib(s['expert_bytes_total'])} in all, {gib(s['expert_bytes_per_device'])} per "
            f"device (ep={s['ep']} over {'+'.join(s['expert_axes']) or 'no axis'})",
            f"  token exchange: {s['exchange']}; all-to-all {gib(s['all_to_all_bytes_per_layer_step'])} per layer "
            f"per step ({gib(s['all_to_all_bytes_per_op'])} per op)"] + _dcn_lines(s.get("dcn"), gib)


def _dcn_lines(dcn, gib) -> list:
    if not dcn:
        return []
    f, h = dcn["flat"], dcn["hierarchical"]
    mine = dcn["all_to_all"]
    return [f"  across DCN ({dcn['slices']} slices of {dcn['per_slice']} expert devices), per layer per step: "
            f"flat {gib(f['bytes'])} in {f['messages']:.0f} messages, hierarchical {gib(h['bytes'])} in "
            f"{h['messages']:.0f} (bytes ÷{dcn['bytes_factor']:.2f}, messages ÷{dcn['messages_factor']:.2f}; "
            f"this plan: {mine}{'' if mine == 'hierarchical' else ', --all-to-all hierarchical for the other'})"]


# ---- helpers for the memory and step-time estimates (analysis.memory, analysis.steptime) ----------

@dataclasses.dataclass(frozen=True)
class MoETerms:
    """The MoE figures the memory and step-time estimates add to the dense decoder formulas, per
    device, for ``b`` rows of ``T`` tokens per micro-batch (``c`` compute-dtype bytes):

    * ``rows``: expert rows the layer holds per token: capacity ``E·C/T`` (the ``(b, E, C, d)`` buffer,
      ``C = ceil(cf·T·k/E)``); dropless ``k`` without expert parallelism, ``ep·k`` with it (the
      receive buffer holds the worst case, ``ep ×`` the local assignments);
    * ``exec_rows``: expert rows multiplied per token: capacity ``E·C/T`` (padding slots are
      computed), dropless ``k`` (the grouped matmul runs the rows that exist);
    * ``d_ff_equivalent``: the dense MLP width whose ``(b, T, f)`` activations equal the experts'
      ``(rows, f_e)`` ones plus the shared experts': ``rows·f_e + n_shared·f_e``;
    * ``saved_extra_per_layer``: what the layer saves besides the MLP-width tensors (remat other than
      ``full``): the dispatched rows and the experts' outputs ``2·rows·b·T·d·c`` and the router's f32
      logits and probabilities ``2·b·T·E·4``;
    * ``gathered_per_layer``: expert weights FSDP shards and the expert kernel gathers before the
      exchange (``parallel.moe``), for one layer: ``Σ elements per layer ÷ (expert × tensor shards)
      × 2c`` (the gathered weights and their gradient before the reduce-scatter); 0 when FSDP
      does not shard them (both in the compute dtype: the step casts before the gather);
    * ``expert_bytes_total`` / ``expert_bytes_per_device``: Σ expert leaves, from the plan's shardings.
    """

    ep: int
    rows: float
    exec_rows: float
    d_ff_equivalent: int
    saved_extra_per_layer: int
    gathered_per_layer: int
    expert_bytes_total: int
    expert_bytes_per_device: int

    def activation_config(self, cfg):
        """``cfg`` as a dense decoder of MLP width ``d_ff_equivalent`` (for the activation formulas)."""
        return dataclasses.replace(cfg, d_ff=self.d_ff_equivalent, n_experts=0)

    def weight_config(self, cfg):
        """``cfg`` as a dense decoder whose MLP weights are all the experts' (``(E + n_shared)·f_e``
        wide): for the compute-dtype copies of the weights the backward keeps."""
        return dataclasses.replace(cfg, d_ff=(cfg.n_experts + cfg.n_shared_experts) * (cfg.d_expert or cfg.d_ff),
                                   n_experts=0)

    def padding_flops_per_token(self, cfg) -> float:
        """Forward FLOPs per token the experts run beyond the ``k`` routed rows (capacity padding)."""
        f_e = cfg.d_expert or cfg.d_ff
        return 2.0 * 3 * cfg.d_model * f_e * cfg.n_layers * max(self.exec_rows - cfg.experts_per_token, 0.0)


def _spec_axes(entry) -> Tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def moe_terms(plan, cfg) -> Optional[MoETerms]:
    """:class:`MoETerms` of ``plan`` for an MoE decoder ``cfg`` (``None`` for a dense model)."""
    if not getattr(cfg, "n_experts", 0) or plan.batch is None:
        return None
    try:
        hash(cfg)
    except TypeError:
        return _moe_terms(plan, cfg)
    return cached(plan, ("moe_terms", cfg), lambda p: _moe_terms(p, cfg))


def _moe_terms(plan, cfg) -> MoETerms:
    lay = layout_of(plan)
    sizes = plan.mesh_sizes
    ex_axes = expert_axes(plan)
    ep = lay.size(ex_axes)
    E, k, d = cfg.n_experts, cfg.experts_per_token, cfg.d_model
    f_e = cfg.d_expert or cfg.d_ff
    B, seq = batch_dims(plan)
    T = seq // max(lay.context, 1)
    b = B // (lay.batch_split * lay.micro_batches)
    c = np.dtype(lay.compute_dtype).itemsize
    if cfg.capacity_factor is not None:
        rows = exec_rows = E * capacity_for(cfg.capacity_factor, seq, k, E) / seq
    else:
        rows, exec_rows = (ep * k if ep > 1 else k), float(k)
    gathered_axes = (set(lay.batch_axes) | set(lay.context_axes)) - set(ex_axes)
    leaves = [l for l in plan.group("params") if "expert" in (l.logical_axes or ())]
    gathered = 0.0
    for leaf in leaves:
        dims = list(zip(leaf.shape, tuple(leaf.spec) + (None,) * (len(leaf.shape) - len(tuple(leaf.spec)))))
        if leaf.logical_axes and leaf.logical_axes[0] == "layers":
            dims = dims[1:]
        axes = [a for _, e in dims for a in _spec_axes(e) if sizes.get(a, 1) > 1]
        if not set(axes) & gathered_axes:
            continue
        kept = [a for a in axes if a not in gathered_axes]
        elems = math.prod(s for s, _ in dims) / math.prod(sizes[a] for a in kept)
        gathered += elems * 2 * c
    return MoETerms(
        ep=ep, rows=float(rows), exec_rows=float(exec_rows),
        d_ff_equivalent=int(round(rows * f_e + cfg.n_shared_experts * f_e)),
        saved_extra_per_layer=int(2 * rows * b * T * d * c + 2 * b * T * E * 4),
        gathered_per_layer=int(gathered),
        expert_bytes_total=sum(l.bytes_total for l in leaves),
        expert_bytes_per_device=sum(l.bytes_per_device for l in leaves))
