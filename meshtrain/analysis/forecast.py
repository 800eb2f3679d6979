"""Step-time forecast: how long a step takes on real chips, its tokens/s per chip, MFU and bottleneck.

The roofline (:mod:`meshtrain.analysis.steptime`) runs every FLOP at the datasheet peak; this module
runs each class of work at the rate such work is *measured* to reach on that chip, and adds the terms
in the order a GPU or TPU executes them (one kernel at a time on the compute stream)::

    fc = forecast_step(plan, cfg, "h200")
    fc.step_s, fc.low_s, fc.high_s          # seconds: forecast and its range
    fc.tokens_per_s_per_chip, fc.mfu        # MFU on the 6·N + 6·L·n·h·T convention (models/flops.py)
    fc.bottleneck                           # the largest term, e.g. "matmul"
    for t in fc.terms: print(t.name, t.seconds)

Terms (per device, ``n`` devices, ``P`` peak FLOP/s, ``W`` HBM bytes/s, ``e_*`` from :data:`EFFICIENCY`)::

    matmul     = (executed FLOPs − attention FLOPs) / n / (P · e_matmul)
    attention  = causal attention FLOPs (6·L·n·h·T per token; × 4/3 when remat re-runs it) / n / (P · e_kernel)
                 kernel: cudnn | cudnn_packed | splash | xla (blockwise) — or, dense, the full T×T
                 square as matmul FLOPs at e_matmul
    memory     = HBM traffic of the planner's model (steptime.hbm_traffic) / (W · e_hbm)
    exposed    = collectives at link bandwidth · e_link, exposed by the rule below
    bubble     = the pipeline's idle ticks: (stack FLOPs × (1/(1 − bubble) − 1)) at e_matmul
    host       = offloaded optimizer state in and out, 2 · optimizer bytes / (host link · e_host)
    step       = matmul + attention + memory + exposed + bubble + host

Overlap rule (what XLA's latency-hiding scheduler can hide): tensor-parallel, expert all-to-all and
pipeline hand-off collectives are on the layer's critical path: exposed in full. FSDP weight
all-gathers hide behind the forward's compute, the backward's re-gathers and gradient
reduce-scatters / all-reduces behind the backward's compute, each phase up to its compute time
(the excess is exposed); and the last layer's gradient reduction has no layer after it to hide
behind: ``1/L`` of the backward's overlappable communication is exposed in any case. The optimizer
offload transfers are exposed (measured on an H200: optimizer offload added its whole transfer time).

Range: ``low_s`` runs every class at the top of its efficiency range, ``high_s`` at the bottom.

Sources (``Forecast.source``, ``plan --json``'s ``forecast.source``):

* ``analytic`` (plain ``meshtrain plan``): the planner's FLOPs and bytes, split into the classes above.
* ``compiled`` (``meshtrain plan --check compile|gpu|tpu``): the classes' FLOPs and bytes are read per
  op from the compiled program's optimized HLO (:mod:`meshtrain.analysis.hlo_cost`, one device's
  program, while bodies × their trip count): ``matmul`` = its dots, convolutions, cuBLAS calls and
  Triton GEMM fusions; ``attention`` = cuDNN fMHA calls (FLOPs from their shapes on the convention
  above) or, for the dense and blockwise kernels, the dots computing and applying scores, at their
  executed FLOPs (the blockwise backward recomputes the scores: more than the analytic ``2×``); a
  splash call (FLOPs not in its HLO) keeps the analytic attention FLOPs; ``memory`` = operand +
  result bytes of every other op and fusion. Each class runs at its :data:`EFFICIENCY` row (not
  re-fitted for this source). ``--check compile`` compiles for XLA:CPU: its dot FLOPs are any
  backend's, its memory-bound bytes XLA:CPU's fusion (more bytes than XLA:GPU's).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Optional, Tuple

from meshtrain.analysis.comms import Overlap, Phase, analytic_collectives, batch_dims
from meshtrain.analysis.hardware import Hardware, get_hardware
from meshtrain.analysis.layout import layout_of, per_device_bytes
from meshtrain.analysis.pipeline import pipeline_shape
from meshtrain.analysis.steptime import (Backend, _communication, _step_flops, backend_of, collective_seconds,
                                         axis_links, Link, executed_flops, hbm_traffic)
from meshtrain.analysis.compiled import has_analytic_model
from meshtrain.analysis.gpu_aot import hardware_target
from meshtrain.analysis.hlo_cost import HloCost
from meshtrain.parallel.resolved import resolve_step
from meshtrain.recipes import AttentionKind, Remat
from meshtrain.strategies import FlashBackend


class Kernel(str, enum.Enum):
    """The attention kernel a step runs (its efficiency differs by an order of magnitude)."""

    DENSE = "dense"                # XLA dot + softmax: the full T×T square at matmul efficiency
    CUDNN = "cudnn"                # cuDNN fused flash attention, plain (BTHD) layout
    CUDNN_PACKED = "cudnn_packed"  # cuDNN fused flash attention, ragged (THD) layout for packed documents
    SPLASH = "splash"              # Pallas splash attention (TPU)
    XLA = "xla"                    # meshtrain's blockwise flash attention in plain XLA


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """An achieved fraction of a peak: ``value`` (the forecast), ``low``..``high`` (its range), ``source``."""

    value: float
    low: float
    high: float
    source: str


_H200_ROWS = "fitted on the H200 device check, BENCHMARKS.md 'Device checks' 2026-11-27 (llama3.2-1b, 8×2048)"
_KERNEL_BENCH = "BENCHMARKS.md 'Packed documents on cuDNN' (H200 kernel timings, fwd+bwd, q (4, 2048, 32, 64))"
_V5P = "fitted on MaxText v5p Llama2-70B (tiering table, 692 tokens/s/chip; tools/forecast_vs_published.py)"
_ASSUMED = "assumed (no measurement on this chip family yet)"

#: (chip family, term) -> efficiency. Families: hopper (h100, h200), ampere (a100), blackwell (b200),
#: tpu (v4, v5e, v5p, v6e), cpu (the measured host profile: its peaks are already achieved rates).
EFFICIENCY: Dict[Tuple[str, str], Efficiency] = {
    ("hopper", "matmul"): Efficiency(0.64, 0.58, 0.70, _H200_ROWS + ": step − cuDNN attention − HBM term"),
    ("hopper", Kernel.CUDNN.value): Efficiency(0.157, 0.13, 0.19, _KERNEL_BENCH + ": 1.33 ms → 15.7 % of peak"),
    ("hopper", Kernel.CUDNN_PACKED.value): Efficiency(0.109, 0.09, 0.13, _H200_ROWS + ": packed cuDNN row, 301.4 ms"),
    ("hopper", Kernel.XLA.value): Efficiency(0.0106, 0.009, 0.012, _H200_ROWS + ": blockwise rows, 834–882 ms"),
    ("hopper", "hbm"): Efficiency(0.80, 0.70, 0.90, _ASSUMED + ": STREAM-like copies reach ~80 % of HBM3/3e"),
    ("hopper", "link"): Efficiency(0.75, 0.60, 0.85, _ASSUMED + ": NCCL bus bandwidth ~75 % of NVLink/IB"),
    ("hopper", "host"): Efficiency(0.87, 0.75, 0.95, _H200_ROWS + ": optimizer offload row, +356 ms for 19.8 GB"),
    ("ampere", "matmul"): Efficiency(0.62, 0.55, 0.70, _ASSUMED + ": as hopper (A100 GEMMs reach ~250 of 312)"),
    ("ampere", Kernel.CUDNN.value): Efficiency(0.30, 0.20, 0.40, _ASSUMED + ": flash kernels reach ~30–40 % on A100"),
    ("ampere", Kernel.XLA.value): Efficiency(0.02, 0.01, 0.03, _ASSUMED),
    ("ampere", "hbm"): Efficiency(0.80, 0.70, 0.90, _ASSUMED),
    ("ampere", "link"): Efficiency(0.75, 0.60, 0.85, _ASSUMED),
    ("ampere", "host"): Efficiency(0.80, 0.60, 0.90, _ASSUMED),
    ("tpu", "matmul"): Efficiency(0.70, 0.62, 0.78, _V5P + ", remat dots"),
    ("tpu", Kernel.SPLASH.value): Efficiency(0.40, 0.30, 0.50, _ASSUMED + ": splash fwd+bwd ~40 % of MXU peak"),
    ("tpu", Kernel.XLA.value): Efficiency(0.05, 0.03, 0.08, _ASSUMED),
    ("tpu", "hbm"): Efficiency(0.80, 0.70, 0.90, _ASSUMED),
    ("tpu", "link"): Efficiency(0.80, 0.65, 0.90, _ASSUMED + ": ICI collectives ~80 % of link bandwidth"),
    ("tpu", "host"): Efficiency(0.80, 0.60, 0.90, _ASSUMED),
}

#: Host link bytes/s per direction (PCIe), for the offload term.
HOST_LINK = {"h100": (64e9, "PCIe Gen5 x16: 64 GB/s per direction"),
             "h200": (64e9, "PCIe Gen5 x16: 64 GB/s per direction"),
             "b200": (64e9, "PCIe Gen5 x16: 64 GB/s per direction"),
             "a100": (32e9, "PCIe Gen4 x16: 32 GB/s per direction")}
_TPU_HOST_LINK = (32e9, "assumed: PCIe Gen4 x16 per TPU chip, 32 GB/s per direction")
#: Compute capability per GPU profile (picks cuDNN's packed layout: Hopper or newer).


def family(hw: Hardware) -> str:
    """``hopper``, ``ampere``, ``blackwell``, ``tpu`` or ``cpu`` for a hardware profile."""
    if hw.name == "cpu":
        return "cpu"
    if hw.name.startswith("tpu"):
        return "tpu"
    return {"a100": "ampere", "b200": "hopper"}.get(hw.name, "hopper")  # b200: hopper's until measured


def efficiency(hw: Hardware, term: str) -> Efficiency:
    """The achieved fraction of ``hw``'s peak for ``term`` (``matmul``, a :class:`Kernel` value, ``hbm``,
    ``link``, ``host``); on ``cpu`` 1.0 (the profile's figures are measured rates already)."""
    fam = family(hw)
    if fam == "cpu":
        return Efficiency(1.0, 1.0, 1.0, "measured host profile (meshtrain.analysis.hardware.measure_cpu)")
    return EFFICIENCY.get((fam, term)) or EFFICIENCY[(fam, "matmul")]


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the forecast: ``seconds`` (and its range), what it counts, at which efficiency."""

    name: str
    seconds: float
    low_s: float
    high_s: float
    detail: str


@dataclasses.dataclass(frozen=True)
class Forecast:
    step_s: float
    low_s: float
    high_s: float
    tokens_per_s_per_chip: float
    mfu: float
    terms: Tuple[Term, ...]
    kernel: str
    hardware: str
    source: str = "analytic"  # "compiled": the classes' FLOPs and bytes from the compiled program's HLO

    @property
    def bottleneck(self) -> str:
        return max(self.terms, key=lambda t: t.seconds).name

    def to_dict(self) -> Dict[str, object]:
        return {"step_s": self.step_s, "low_s": self.low_s, "high_s": self.high_s,
                "tokens_per_s_per_chip": self.tokens_per_s_per_chip, "mfu": self.mfu, "bottleneck": self.bottleneck,
                "attention_kernel": self.kernel, "hardware": self.hardware, "source": self.source,
                "terms": {t.name: {"seconds": t.seconds, "low_s": t.low_s, "high_s": t.high_s, "detail": t.detail}
                          for t in self.terms}}

    def line(self) -> str:
        """The report's forecast line: step, range, tokens/s per chip, MFU, bottleneck and every term."""
        terms = ", ".join(f"{t.name} {t.seconds * 1e3:,.1f}" for t in self.terms if t.seconds > 0)
        return (f"forecast ≈ {self.step_s * 1e3:,.1f} ms/step ({self.low_s * 1e3:,.1f}–{self.high_s * 1e3:,.1f}), "
                f"{self.tokens_per_s_per_chip:,.0f} tokens/s per chip, MFU {self.mfu:.1%}, bottleneck "
                f"{self.bottleneck}; terms ms: {terms} (attention kernel {self.kernel}; FLOPs and bytes {self.source}; "
                f"efficiencies: "
                f"meshtrain.analysis.forecast.EFFICIENCY)")


def attention_kernel(plan, hw: Hardware) -> Kernel:
    """The kernel ``plan``'s attention runs on ``hw``: read from :func:`meshtrain.parallel.resolved.resolve_step`
    for the platform ``hw`` compiles for (the one decision the step's kernels make; never re-derived here)."""
    choice = resolve_step(plan, hardware_target(hw)).attention
    if choice.kind is AttentionKind.DENSE:
        return Kernel.DENSE
    if choice.backend is FlashBackend.SPLASH:
        return Kernel.SPLASH
    if choice.backend is FlashBackend.CUDNN:
        return Kernel.CUDNN_PACKED if choice.segmented else Kernel.CUDNN
    return Kernel.XLA


def forecast_step(plan, cfg, hardware: "Hardware | str", *, kernel: "Kernel | str | None" = None, cost=None,
                  collectives=None, hlo: Optional[HloCost] = None) -> Forecast:
    """The step-time forecast of ``plan`` (a decoder ``cfg``) on ``hardware`` (see the module docstring).
    ``kernel`` overrides the attention kernel (e.g. what a measured run reported); ``cost`` is a
    compiled :class:`~meshtrain.analysis.compiled.ProgramCost` whose FLOPs replace the analytic ones;
    ``hlo``: the per-op cost of the compiled program (``hlo_cost(compiled.as_text())``, one device), whose
    classes replace the analytic split (``source="compiled"``)."""
    lay = layout_of(plan)
    n = lay.num_devices
    hw = get_hardware(hardware, num_devices=n)
    kern = Kernel(kernel) if kernel is not None else attention_kernel(plan, hw)
    B, T = batch_dims(plan)
    flops = _step_flops(cfg, B, T, plan.recipe.remat)
    executed, executed_fwd = executed_flops(plan, cfg, flops)
    fwd_share = executed_fwd / executed if executed else 0.0
    if cost is not None and getattr(cost, "flops", None):
        executed = float(cost.flops)
    pipe = pipeline_shape(plan)
    stack = pipe.stack_factor if pipe is not None else 1.0
    split = _analytic_split(plan, cfg, executed, kern, stack)
    if hlo is not None:
        split = _compiled_split(hlo, n, kern, stack, split)
    matmul_flops, att_flops, att_kernel_flops, att_detail, traffic = split
    att_eff = efficiency(hw, "matmul" if kern is Kernel.DENSE else kern.value)
    terms = [_flop_term("matmul", matmul_flops / stack, n, hw, efficiency(hw, "matmul"), "weight matmuls"),
             _flop_term("attention", att_flops, n, hw, att_eff, att_detail)]
    e_hbm = efficiency(hw, "hbm")
    terms.append(_rate_term("memory", traffic, hw.hbm_bytes_per_s, e_hbm, "HBM traffic of element-wise work"))
    compute = sum(t.seconds for t in terms)
    terms.append(_exposed_term(plan, cfg, lay, hw, compute, fwd_share, collectives))
    if pipe is not None and pipe.bubble > 0:
        idle = (matmul_flops + att_kernel_flops) * (1 - 1 / stack)
        terms.append(_flop_term("bubble", idle, n, hw, efficiency(hw, "matmul"), f"pipeline bubble {pipe.bubble:.0%}"))
    host = _host_term(plan, hw)
    if host is not None:
        terms.append(host)
    step = sum(t.seconds for t in terms)
    low, high = sum(t.low_s for t in terms), sum(t.high_s for t in terms)
    tokens = B * T
    mfu = flops.model / (step * n * hw.peak_flops) if step > 0 else 0.0
    return Forecast(step, low, high, tokens / step / n if step > 0 else 0.0, mfu, tuple(terms), kern.value, hw.name,
                    "analytic" if hlo is None else "compiled")


def _analytic_split(plan, cfg, executed, kern: Kernel, stack):
    """``(matmul, attention, dense attention in the stack, attention detail, HBM bytes)``, all devices together,
    from the planner's model."""
    B, T = batch_dims(plan)
    att_full_fwd = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T * (B * T)  # 4·L·n·h·T per token, forward
    rerun = 1 if plan.recipe.remat in (Remat.FULL, Remat.DOTS_NO_BATCH) else 0
    att_square = att_full_fwd * (3 + rerun) * stack  # in executed: the full square, fwd + bwd + re-run
    matmul = max(executed - att_square, 0.0)
    traffic = hbm_traffic(plan, cfg, layout_of(plan))
    if kern is Kernel.DENSE:
        return matmul, att_square / stack, att_square, "dense: T×T square as matmuls", traffic
    return matmul, att_full_fwd / 2 * (3 + rerun), 0.0, f"{kern.value} kernel", traffic


def _compiled_split(hlo: HloCost, n: int, kern: Kernel, stack, analytic):
    """:func:`_analytic_split`'s tuple from the compiled program's per-op cost (one device's: FLOPs × ``n``;
    HBM bytes stay per device). Its FLOPs include a pipeline's idle ticks, as the analytic ``executed`` does
    (÷ ``stack`` for the busy part). A kernel whose FLOPs the HLO does not state (splash) keeps ``analytic``'s
    attention FLOPs."""
    matmul, att = hlo.matmul_flops * n, hlo.attention_flops * n
    if not hlo.attention_flops_known:
        return (matmul, analytic[1], analytic[2],
                f"{kern.value}: {hlo.attention_calls} kernel calls (FLOPs analytic: not in the HLO)", hlo.memory_bytes)
    what = f"{hlo.attention_calls} {kern.value} kernel calls" if hlo.attention_calls else f"{kern.value} attention dots"
    return matmul, att / stack, att, what + " (compiled)", hlo.memory_bytes


def _flop_term(name, flops, n, hw, e: Efficiency, what) -> Term:
    per = flops / n / hw.peak_flops
    return Term(name, per / e.value, per / e.high, per / e.low, f"{what}: {flops:.3g} FLOPs at {e.value:.1%} of peak")


def _rate_term(name, nbytes, rate, e: Efficiency, what) -> Term:
    per = nbytes / rate
    return Term(name, per / e.value, per / e.high, per / e.low,
                f"{what}: {nbytes / 1e9:.3g} GB at {e.value:.0%} of {rate / 1e9:,.0f} GB/s")


def _exposed_term(plan, cfg, lay, hw, compute_s, fwd_share, collectives) -> Term:
    """Exposed communication by the module docstring's rule, at the middle, top and bottom of ``e_link``."""
    backend = backend_of(hw)
    ops = collectives if collectives is not None else analytic_collectives(plan, cfg, backend)
    if not ops:
        return Term("exposed", 0.0, 0.0, 0.0, "no collectives")
    e = efficiency(hw, "link")
    out = []
    for frac in (e.value, e.high, e.low):
        slow_hw = dataclasses.replace(hw, fast_link_bytes_per_s=hw.fast_link_bytes_per_s * frac,
                                      slow_link_bytes_per_s=hw.slow_link_bytes_per_s * frac)
        _, exposed, _ = _communication(ops, lay, slow_hw, backend, compute_s, fwd_share)
        out.append(exposed + _tail(ops, lay, slow_hw, backend, getattr(cfg, "n_layers", 1)))
    wire = sum(o.wire_bytes_per_step for o in ops)
    return Term("exposed", out[0], out[1], out[2],
                f"{len(ops)} collectives, {wire / 1e9:.3g} GB on the wire per device, links at {e.value:.0%}")


def _tail(ops, lay, hw, backend, n_layers) -> float:
    """The last layer's gradient reduction: ``1/L`` of the backward's overlappable communication."""
    if backend is Backend.CPU:
        return 0.0
    links = axis_links(lay, hw)
    total = 0.0
    for op in ops:
        if op.phase is Phase.BACKWARD and op.overlap is not Overlap.EXPOSED:
            link = Link.SLOW if any(links.get(a) is Link.SLOW for a in op.axes) else Link.FAST
            total += collective_seconds(op, link, hw)
    return total / max(n_layers, 1)


def _host_term(plan, hw) -> Optional[Term]:
    """Optimizer-state offload: the state comes in for the update and goes back out, every step."""
    if str(getattr(plan.recipe.offload, "value", plan.recipe.offload)) != "optimizer":
        return None
    nbytes = 2.0 * per_device_bytes(plan).get("optimizer_host", 0)
    rate, _ = HOST_LINK.get(hw.name, _TPU_HOST_LINK)
    if family(hw) == "cpu":
        rate = hw.hbm_bytes_per_s  # host and device share the RAM
    return _rate_term("host", nbytes, rate, efficiency(hw, "host"), "optimizer state in and out")


def forecast_fields(plan, cfg, hardware, *, cost=None) -> Optional[Dict[str, object]]:
    """``plan --json``'s ``forecast`` object (``None`` for a model without analytic FLOPs)."""

    if not has_analytic_model(cfg) or getattr(plan, "batch", None) is None:
        return None
    return forecast_step(plan, cfg, hardware, cost=cost).to_dict()


def forecast_text(plan, cfg, hardware) -> str:
    """The text report's forecast line ('' for a model without analytic FLOPs)."""

    if not has_analytic_model(cfg) or getattr(plan, "batch", None) is None:
        return ""
    return forecast_step(plan, cfg, hardware).line()


def with_forecast(out, plan, cfg, args, *, hlo: Optional[HloCost] = None):
    """``meshtrain plan``'s report with the forecast added: a ``forecast`` object in the JSON dict, a
    forecast line after the text report's step-time line (unchanged when the model has no analytic
    FLOPs, or when the report has its forecast already). ``args``: the plan command's (``--hardware``,
    ``--slices``); ``hlo``: the compiled program's per-op cost (``--check``), else the analytic split."""

    if plan is None or not has_analytic_model(cfg) or getattr(plan, "batch", None) is None:
        return out
    if isinstance(out, dict) and "forecast" in out or isinstance(out, str) and "\nforecast ≈ " in out:
        return out  # the report added it from its compiled program (--check)
    hardware = getattr(args, "hardware", "cpu") or "cpu"
    slices = getattr(args, "slices", None) or 1
    if slices > 1:
        from meshtrain.analysis.planner import PlanRequest  # lazy: the planner imports this module's users

        hardware = PlanRequest(None, plan.num_devices, hardware, slices=slices).hw()
    fc = forecast_step(plan, cfg, hardware, hlo=hlo)
    if isinstance(out, dict):
        return {**out, "forecast": fc.to_dict()}
    lines = out.split("\n")
    at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("step time")), len(lines))
    return "\n".join(lines[:at] + [fc.line()] + lines[at:])
