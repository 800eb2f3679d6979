"""Mixture-of-experts figures of a plan: parameters (total and active), expert-weight memory per
device, the token exchange (all-to-all bytes per step per layer) and how it is done.

Example::

    moe_summary(plan, get_config("mixtral-8x7b"), "tpu")
    # {'experts': 8, 'top_k': 2, 'ep': 8, 'exchange': 'capacity (padded fixed-size all-to-all)',
    #  'expert_bytes_per_device': ..., 'all_to_all_bytes_per_layer_step': ..., ...}

Formulas: expert-weight bytes per device = Σ over expert leaves of the plan's bytes per device
(``total / ep`` when only ``expert`` splits them; FSDP/TP divide further); all-to-all bytes in
:func:`meshtrain.analysis.comms.moe_exchange_bytes`; MFU counts *active* FLOPs
(:func:`meshtrain.models.flops.matmul_params`).
"""

from __future__ import annotations

from typing import Dict, Optional

from meshtrain.analysis.comms import Backend, expert_axes, moe_exchange_bytes


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
    }


def moe_lines(summary: Optional[Dict[str, object]]) -> list:
    """Report lines for :func:`moe_summary` (empty for a dense model)."""
    if not summary:
        return []
    gib = lambda n: f"{n / 2 ** 30:.3f} GiB" if n >= 2 ** 26 else f"{n / 2 ** 10:,.1f} KiB"  # noqa: E731
    s = summary
    return ["", f"mixture of experts: {s['experts']} experts, top-{s['top_k']}, {s['shared_experts']} shared, "
                f"{s['dispatch']}; {s['params']:,} parameters, {s['active_params']:,} active per token "
                f"(MFU by {s['mfu_basis']})",
            f"  expert weights: {gib(s['expert_bytes_total'])} in all, {gib(s['expert_bytes_per_device'])} per "
            f"device (ep={s['ep']} over {'+'.join(s['expert_axes']) or 'no axis'})",
            f"  token exchange: {s['exchange']}; all-to-all {gib(s['all_to_all_bytes_per_layer_step'])} per layer "
            f"per step ({gib(s['all_to_all_bytes_per_op'])} per op)"]
