"""The step-time forecast (meshtrain/analysis/forecast.py) against published training throughput.

    python tools/forecast_vs_published.py              # a table
    python tools/forecast_vs_published.py --markdown   # the table for NOTES / BENCHMARKS.md
    python tools/forecast_vs_published.py --json

Each published run is planned at its shape (chips, mesh, per-chip batch, sequence length, bf16 compute,
f32 master weights, flash attention) on an AbstractMesh (nothing runs, any chip count) and forecast.
``role``: ``calibration`` rows set a constant of :data:`meshtrain.analysis.forecast.EFFICIENCY` (the
TPU matmul efficiency is fitted on MaxText's v5p Llama2-70B row); ``held-out`` rows were not used for
any constant: the forecast must be within 25 % of their tokens/s per chip (MFU where only MFU is
published, on the source's own FLOP convention, noted). Misses are listed with their reason.

Megatron-LM's scaling table (arXiv 2104.04473, Table 1) publishes TFLOP/s per GPU on its own count,
which includes the recomputed forward: ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` per iteration. Its rows
are compared in tokens/s per GPU, converted with that formula (:func:`megatron_tokens_per_s`).

Published figures that are not compared (and why) are in :data:`LEFT_OUT`. Exit code 0 always (a
miss is a finding); ``--strict`` exits 1 when a held-out row without a stated reason misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext (README performance tables)"
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
PALM = "https://arxiv.org/abs/2204.02311 (PaLM, Chowdhery et al. 2022: 6144 TPU v4, 46.2 % MFU)"
#: Megatron-LM's Table 1 as text (the README's is an image; the paper is not stored as text): BigScience's
#: notes transcribe it (heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU, % of peak, aggregate
#: PFLOP/s; a second transcription, https://github.com/SotaroKaneda/MLCarbon data/megatron_table.csv, gives the
#: same figures); Megatron-LM's own run script for the table gives each row's micro-batch, interleaving and
#: recomputation.
MEGATRON = ("https://arxiv.org/abs/2104.04473 Table 1 (A100 80GB, seq 2048, vocab 51,200) as in "
            "https://github.com/bigscience-workshop/bigscience (experiments/meg-notes.md); micro-batch and "
            "interleaving from https://github.com/NVIDIA/Megatron-LM "
            "(examples/academic_paper_scripts/sc21/run_table_1.sh)")
#: PaLM 540B's shape (118 layers, d_model 18,432, 48 heads of 256, multi-query, SwiGLU of 4·d_model,
#: 256k vocabulary), as its paper's Table 1 gives it.
PALM_540B = dict(name="palm-540b", vocab_size=256_000, d_model=18_432, n_layers=118, n_heads=48, n_kv_heads=1,
                 head_dim=256, d_ff=73_728, max_seq_len=2048, tie_embeddings=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """One published run, its shape as planned, and its figure (tokens/s per chip, or MFU)."""

    name: str
    source: str
    model: object               # a meshtrain config name or a DecoderConfig keyword dict
    hardware: str
    mesh: Tuple[Tuple[str, int], ...]
    recipe: str
    batch_per_chip: float
    seq_len: int
    remat: str
    role: str                   # "calibration" or "held-out"
    tokens_per_s_per_chip: Optional[float] = None
    mfu: Optional[float] = None  # compared instead when no tokens/s is published
    slices: int = 1
    options: Tuple[Tuple[str, object], ...] = ()  # further recipe options (pipeline micro-batches, schedule, ...)
    assumed: str = ""
    reason: str = ""            # why a miss is expected (a known gap of the forecast); empty: none known

    @property
    def chips(self) -> int:
        out = 1
        for _, s in self.mesh:
            out *= s
        return out


CASES = [
    Case("v5p Llama2-70B", f"{MAXTEXT}: tiering, v5p Gold, 692 tokens/s/chip", "llama2-70b", "tpu-v5p",
         (("fsdp", 512),), "fsdp", 4, 4096, "dots", "calibration", tokens_per_s_per_chip=692,
         assumed="batch 4 per chip; remat dots (the table gives chips, bf16 and SL only; its 65.4 % MFU with full "
                 "recomputation would be an 87 % hardware FLOP rate)"),
    Case("v6e Llama3.1-8B", f"{MAXTEXT}: tiering, Trillium Gold, 7,207 tokens/s/chip", "llama3.1-8b", "tpu-v6e",
         (("fsdp", 256),), "fsdp", 4, 8192, "dots", "held-out", tokens_per_s_per_chip=7207,
         assumed="remat dots: MaxText's run offloads q/k/v/out and layer inputs to the host instead of recomputing",
         reason="v6e is calibrated by v5p's matmul efficiency; MaxText's host offload of activations and "
                "v6e's 918 TFLOP/s against 1.6 TB/s HBM are not modelled"),
    Case("H100 Llama2-7B", f"{MAXTEXT}: A3 table, 1× A3 (8 GPUs), 492 TFLOP/s/GPU (full-square attention) → "
         "10,676 tokens/s/GPU", "llama2-7b", "h100", (("fsdp", 8),), "fsdp", 4, 4096, "dots", "held-out",
         tokens_per_s_per_chip=10676, assumed="batch 4 per GPU, remat dots (as the v5p row)"),
    Case("H100 Llama3.1-8B torchtitan", f"{TORCHTITAN}: Table 1, FSDP + torch.compile, 6,667 TPS/GPU",
         "llama3.1-8b", "h100", (("fsdp", 8),), "fsdp", 2, 8192, "dots", "held-out",
         tokens_per_s_per_chip=6667,
         assumed="seq 8192 (torchtitan's Llama 3 8B default); selective op AC as remat dots",
         reason="the Grand Teton H100s run at 500 W with 96 GB HBM2e at 2.4 TB/s, not the 700 W SXM5 "
                "profile (989 TFLOP/s, 3.35 TB/s) the forecast uses"),
    Case("A100 Llama3-8B torchtitan", f"{TORCHTITAN}: FSDP2 on 64 A100, selective op AC, 2,973 WPS",
         "llama3.1-8b", "a100", (("fsdp", 64),), "fsdp", 1, 8192, "dots", "held-out",
         tokens_per_s_per_chip=2973, assumed="seq 8192; selective op AC as remat dots"),
    Case("A100 Llama3-70B torchtitan", f"{TORCHTITAN}: FSDP2 on 64 A100, full AC, 331 WPS", "llama3-70b", "a100",
         (("fsdp", 64),), "fsdp", 1, 8192, "full", "held-out", tokens_per_s_per_chip=331, assumed="seq 8192"),
    Case("v4 PaLM 540B", f"{PALM}", PALM_540B, "tpu-v4", (("data", 2), ("fsdp", 256), ("tensor", 12)), "fsdp_tp",
         2048 / 6144, 2048, "full", "held-out", mfu=0.462, slices=2,
         assumed="batch 2048 × 2048 (the final batch size); 12-way model parallel × 256 FSDP in each pod, data parallel over the 2 pods (DCN); remat "
                 "full (its HFU 57.8 % / MFU 46.2 % = 1.25 says most of the forward is recomputed); MFU compared "
                 "on our 6·N + 6·L·n·h·T convention (attention is 0.55 % of 6·N at T = 2048, so any attention "
                 "convention gives the same MFU within 1 %)",
         reason="PaLM's parallel attention + MLP block (one fused matmul input) is not modelled"),
]


def megatron_tokens_per_s(tflops_per_gpu: float, layers: int, hidden: int, seq: int = 2048, vocab: int = 51_200):
    """Tokens/s per GPU from Megatron-LM's published TFLOP/s per GPU, with the paper's own FLOP count
    per iteration ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` (it counts the recomputed forward) divided by the
    ``B·s`` tokens. E.g. ``megatron_tokens_per_s(163, 128, 25600)`` ≈ 20.0 (the 1T row)."""
    flops_per_token = 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops_per_gpu * 1e12 / flops_per_token


def megatron_case(size: str, heads: int, hidden: int, layers: int, tensor: int, pipeline: int, gpus: int,
                  batch: int, micro_batch: int, layers_per_virtual_stage: int, tflops: float,
                  reason: str = "") -> Case:
    """One row of Megatron-LM's Table 1 as a held-out :class:`Case`: a GPT of ``layers`` × ``hidden`` with
    ``heads`` heads on ``gpus`` A100s, tensor × pipeline × data parallel as published, the paper's global
    ``batch`` in micro-batches of ``micro_batch`` rows per data-parallel rank, interleaved when the run
    script gives ``layers_per_virtual_stage`` (0: plain 1F1B), remat full. E.g. the 1T row:
    ``megatron_case("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163)``."""
    data = gpus // (tensor * pipeline)
    # GPT's GELU MLP (two h×4h matrices) as meshtrain's SwiGLU (three h×f): f = 8h/3 has its weights and FLOPs
    # (rounded to a multiple of the tensor size)
    d_ff = round(8 * hidden / 3 / 8) * 8
    model = dict(name=f"megatron-gpt-{size.lower()}", vocab_size=51_200, d_model=hidden, n_layers=layers,
                 n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads, d_ff=d_ff, max_seq_len=2048,
                 tie_embeddings=True)
    if pipeline > 1:
        micro_batches = batch // (data * micro_batch)
        mesh = (("stage", pipeline), ("data", data), ("fsdp", 1), ("tensor", tensor))
        if layers_per_virtual_stage:
            repeats = layers // pipeline // layers_per_virtual_stage
            options = (("pipeline_micro_batches", micro_batches), ("schedule", "circular"), ("repeats", repeats))
            how = (f"interleaved 1F1B ({layers_per_virtual_stage} layers per virtual stage) as meshtrain's circular, "
                   f"{repeats} repeats (the same bubble; circular keeps every micro-batch's stage input)")
        else:
            options = (("pipeline_micro_batches", micro_batches), ("schedule", "1f1b"))
            how = "1F1B as meshtrain's 1f1b"
        recipe, layout = "pp_fsdp_tp", f"{micro_batches} micro-batches of {micro_batch} per data rank, {how}"
    else:
        mesh, recipe = (("data", data), ("tensor", tensor)), "tp"
        accum = batch // (data * micro_batch)
        options = (("grad_accum", accum),) if accum > 1 else ()
        layout = f"micro-batch {micro_batch} per data rank" + (f", {accum} accumulated" if accum > 1 else "")
    published = megatron_tokens_per_s(tflops, layers, hidden)
    return Case(
        f"A100 Megatron GPT {size}", f"{MEGATRON}: GPT {size}, {gpus} A100, {tflops:g} TFLOP/s per GPU → "
        f"{published:,.1f} tokens/s/GPU", model, "a100", mesh, recipe, batch / gpus, 2048, "full", "held-out",
        tokens_per_s_per_chip=published, options=options, reason=reason,
        assumed=f"{layers} layers, d {hidden}, {heads} heads, tied embeddings, GELU MLP 4·d as SwiGLU d_ff "
                f"{d_ff} ≈ 8·d/3 (same FLOPs); tensor {tensor} × pipeline {pipeline} × data {data}, {layout}; "
                f"remat full (--recompute-method uniform); fp16 there, bf16 here (same peak); tokens/s = TFLOP/s "
                f"÷ the paper's 96·l·h²·(1 + s/6h + V/16lh) FLOPs per token (counts the recomputed forward)")


#: What is left of a deep pipeline's ``exposed`` term (tools/forecast_vs_published.py --json: terms_ms; the
#: collectives from meshtrain.analysis.comms) since every schedule reduces its data-parallel gradients once a
#: step (it reduced them on every tick before 2026-11-30: 76.1B 0.71, 145.6B 0.66, 310.1B 0.40 then).
_STAGE_HANDOFF = ("exposed: the `stage` collectives on the critical path: meshtrain's circular pipeline hands each "
                  "stage's output on and its cotangent back on every tick (147 GB of collective-permutes, as "
                  "Megatron's point-to-point sends) and all-reduces the stack's inputs' cotangents and its outputs "
                  "once a step (91 GB on the wire), which Megatron does not (`stage` traffic 253 GB on the wire per "
                  "GPU a step, 423 GB before this session; beside 724 GB of tensor-parallel all-reduces both "
                  "frameworks run)")

#: Megatron-LM Table 1 (heads, hidden, layers, tensor, pipeline, GPUs, batch as published; micro-batch and
#: layers per virtual stage from the paper's run_table_1.sh; TFLOP/s per GPU as published).
MEGATRON_CASES = [
    megatron_case("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137),
    megatron_case("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 0, 138),
    megatron_case("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 0, 142),
    megatron_case("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 0, 135),
    megatron_case("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 0, 138),
    megatron_case("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    megatron_case("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    megatron_case("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    megatron_case("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163, reason=_STAGE_HANDOFF),
    megatron_case("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163,
                  reason="matmul: meshtrain's 1f1b re-runs each stage's forward in its VJP on top of remat full "
                  "(5 forward-pass equivalents of matmul work where Megatron's full recompute runs 4: 111.6 s of "
                  "matmul in the forecast, ~89 s at 4, which would put the row near 0.8), beside a 13.7 s bubble "
                  "(64 stages, 512 micro-batches) and 14.3 s of exposed tensor-parallel all-reduces"),
]
CASES += MEGATRON_CASES

#: Published figures found but not compared, and why.
LEFT_OUT = [
    ("Megatron-LM's README MFU table (22B / 175B / 530B / 1T, arXiv 2205.05198: sequence parallelism and "
     "selective recomputation, data parallel 1)",
     "a second table, MFU only; its rows' shapes, batches and interleaving are in that paper's Table 3, found only "
     "in third-party summaries, not in a run script or the README; not compared"),
    ("NeMo LLAMA3-8B / LLAMA2-7B / GPT3-175B rows (docs.nvidia.com NeMo performance summary)",
     "FP8 runs; the forecast has no FP8 efficiency yet"),
    ("MaxText v5e 16B/32B/64B/128B (configs/v5e)", "the models' shapes are in MaxText's configs, not stored here"),
]


def _config(model):
    from meshtrain.models import get_config
    from meshtrain.models.decoder import DecoderConfig

    return get_config(model) if isinstance(model, str) else DecoderConfig(**model)


def forecast_case(case: Case) -> Dict[str, object]:
    """Plan ``case`` on an AbstractMesh and forecast it."""
    import optax

    import meshtrain as mt
    from meshtrain.analysis.forecast import forecast_step
    from meshtrain.analysis.planner import PlanRequest
    from meshtrain.models import model_factory

    cfg = _config(case.model)
    recipe = mt.get_recipe(case.recipe).with_mesh(**dict(case.mesh)).with_options(
        param_dtype="float32", compute_dtype="bfloat16", remat=case.remat, local_attention="flash",
        replicate_indivisible=("kv_heads", "vocab"), **dict(case.options))  # PaLM: one K/V head; 256k vocab ∤ 12
    abstract = mt.abstract_state(model_factory(cfg), optax.adamw(1e-4))
    batch = round(case.batch_per_chip * case.chips)
    spec = mt.BatchSpec(batch, case.seq_len, keys=("inputs", "targets", "positions"))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(case.chips), batch=spec)
    hw = PlanRequest(None, case.chips, case.hardware, slices=case.slices).hw()
    fc = forecast_step(plan, cfg, hw)
    if case.tokens_per_s_per_chip is not None:
        ours, theirs, what = fc.tokens_per_s_per_chip, case.tokens_per_s_per_chip, "tokens/s/chip"
    else:
        ours, theirs, what = fc.mfu, case.mfu, "MFU"
    ratio = ours / theirs
    return {"case": case.name, "role": case.role, "source": case.source, "chips": case.chips,
            "hardware": case.hardware, "batch": f"{batch}×{case.seq_len}", "remat": case.remat, "compared": what,
            "forecast": ours, "published": theirs, "ratio": ratio, "within_25": abs(ratio - 1) <= 0.25,
            "mfu": fc.mfu, "bottleneck": fc.bottleneck, "kernel": fc.kernel, "step_s": fc.step_s,
            "assumed": case.assumed, "reason": case.reason,
            "terms_ms": {t.name: round(t.seconds * 1e3, 1) for t in fc.terms}}


def _fmt(x: float, what: str) -> str:
    return f"{x:.1%}" if what == "MFU" else f"{x:,.0f}"


def markdown(rows: List[Dict[str, object]]) -> str:
    out = ["| case | role | source | chips | batch | remat | compared | forecast | published | forecast / published "
           "| within 25 % | bottleneck | assumed; reason for a miss |", "|" + "---|" * 13]
    for r in rows:
        note = r["assumed"] + (f"; miss: {r['reason']}" if r["reason"] and not r["within_25"] else "")
        out.append(f"| {r['case']} | {r['role']} | {r['source']} | {r['chips']} | {r['batch']} | {r['remat']} | "
                   f"{r['compared']} | {_fmt(r['forecast'], r['compared'])} | {_fmt(r['published'], r['compared'])} "
                   f"| {r['ratio']:.2f} | {'yes' if r['within_25'] else 'NO'} | {r['bottleneck']} | {note} |")
    out += ["", "Left out:"] + [f"- {what}: {why}" for what, why in LEFT_OUT]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when a held-out row without a known reason misses")
    args = p.parse_args(argv)
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    rows = [forecast_case(c) for c in CASES if not wanted or c.name in wanted]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            print(f"{r['case']:<28} {r['role']:<11} {r['compared']:<13} forecast {_fmt(r['forecast'], r['compared']):>8}"
                  f" published {_fmt(r['published'], r['compared']):>8} ratio {r['ratio']:.2f} "
                  f"{'ok' if r['within_25'] else 'MISS'} ({r['bottleneck']}-bound; ms: {r['terms_ms']})")
    bad = [r for r in rows if r["role"] == "held-out" and not r["within_25"] and not r["reason"]]
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
