"""The planner: evaluate one recipe + mesh, or search recipes × mesh factorisations × remat ×
micro-batches, drop what does not fit, rank the rest by estimated step time.

Example::

    req = PlanRequest(get_config("llama3-70b"), num_devices=256, hardware="tpu-v5p")
    result = plan_auto(req)
    best = result.winner                     # Candidate: recipe, plan, memory, step time, warnings
    print(result.why)                        # why it beat the runner-up
    one = evaluate(req, get_recipe("fsdp_tp").with_mesh(fsdp=32, tensor=8))

Everything is analytic (an ``AbstractMesh`` when the devices do not exist), so a 256-chip search
takes seconds on a laptop. Warnings follow the usual rules: tensor parallelism beyond the fast-link
domain, too few tokens per device for FSDP to hide its all-gathers, head counts not divisible
by ``tensor × context``, expert parallelism across the slow links, a pipeline bubble above 25 %.

Mixture-of-experts models are estimated with their expert weights as the plan shards them, active
FLOPs and the token all-to-all (the ``ep`` recipes' ``expert`` axis is searched like any other);
pipelines (``pp`` recipes, ``stage`` > 1) with each of ``PlanRequest.schedules`` (circular with 2
repeats) and ``m >= p`` micro-batches, their memory per schedule, the bubble in the step time and the
stage hand-offs. ``PlanRequest.slices`` models several TPU slices or GPU nodes: axes spanning more
than ``devices / slices`` use the slow links, so ``stage`` (outermost) or ``data`` may cross the DCN.
``AutoResult.why`` says why the winner beat the runner-up and, when it uses neither, the best
expert-parallel (MoE) and pipelined layouts and what they lose on, or why none was usable.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

from meshtrain.abstract import abstract_state
from meshtrain.analysis.comms import expert_axes, expert_exchange
from meshtrain.analysis.hardware import Hardware, get_hardware
from meshtrain.analysis.layout import cached, layout_of, plan_variant, resolved_step
from meshtrain.analysis.memory import Fit, MemoryEstimate, estimate_memory
from meshtrain.analysis.pipeline import is_pipelined, pipeline_problem, pipeline_shape
from meshtrain.analysis.steptime import Link, StepTimeEstimate, axis_links, backend_of, estimate_step_time
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.models import model_factory
from meshtrain.parallel.pipeline import bubble_warning, config_for
from meshtrain.parallel.resolved import batch_splits, batch_splits_option, recipe_attention_kind
from meshtrain.plan import BatchSpec, fmt_bytes, make_plan
from meshtrain.recipes import BUILTIN_RECIPES, AttentionKind, Recipe, Remat, Schedule, get_recipe
from meshtrain.strategies import Pipeline

AUTO_REMATS = (Remat.NONE, Remat.DOTS_NO_BATCH, Remat.FULL)


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan: a decoder config on ``num_devices`` devices of ``hardware``.

    ``batch_size`` is global (default: one sequence per device), ``seq_len`` defaults to the model's
    maximum. ``compute_dtype`` defaults to bfloat16 on accelerators (their peak figures are bf16)
    and to the recipe's own on ``cpu``; ``param_dtype`` to the recipe's. ``recipes``: names to search
    (default: all built-ins); ``remats``, ``micro_batches`` (default: powers of two up to
    ``max_micro_batches`` that divide the per-device batch) bound the search.
    """

    model: object
    num_devices: int
    hardware: str = "cpu"
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    recipes: Tuple[str, ...] = ()
    remats: Tuple[Remat, ...] = AUTO_REMATS
    compute_dtype: Optional[str] = None
    param_dtype: Optional[str] = None
    max_micro_batches: int = 16
    micro_batches: Tuple[int, ...] = ()
    #: slices (TPU) or nodes (GPU) the devices span: the fast-link domain is at most ``num_devices / slices``
    #: devices, so mesh axes spanning more cross the slow links (DCN / InfiniBand); 1 = the chip's own domain
    slices: int = 1
    #: attention kind for the recipes whose own is ``dense`` (e.g. ``flash`` for long sequences); None: the recipe's
    attention: Optional[str] = None
    #: pipeline schedules tried for the ``pp`` recipes (circular with 2 repeats where the layers divide)
    schedules: Tuple[str, ...] = ("gpipe", "1f1b", "circular")

    def hw(self) -> Hardware:
        return self._hardware

    @functools.cached_property  # the request is immutable: resolve the profile once
    def _hardware(self) -> Hardware:
        hw = get_hardware(self.hardware, num_devices=self.num_devices)
        if self.slices > 1:
            if self.num_devices % self.slices:
                raise ConfigError(f"{self.num_devices} devices do not split into {self.slices} slices/nodes; pick a "
                                  f"--slices that divides --devices")
            domain = min(hw.fast_domain, self.num_devices // self.slices)
            hw = dataclasses.replace(hw, fast_domain=domain, sources={
                **hw.sources, "fast_domain": f"{self.num_devices} devices in {self.slices} slices/nodes → "
                                            f"{domain} per fast-link domain (plan request)"})
        return hw

    @property
    def global_batch(self) -> int:
        return self.batch_size or self.num_devices

    @property
    def tokens_seq(self) -> int:
        return self.seq_len or self.model.max_seq_len

    def dtypes(self, recipe: Recipe) -> Dict[str, object]:
        compute = self.compute_dtype or ("bfloat16" if self.hw().name != "cpu" else recipe.compute_dtype)
        out: Dict[str, object] = {"compute_dtype": compute, "param_dtype": self.param_dtype or recipe.param_dtype}
        if self.attention and recipe_attention_kind(recipe) is AttentionKind.DENSE:  # no cp: the local kernel
            out["local_attention"] = AttentionKind(self.attention).value
        return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One evaluated layout. ``rejected`` says why it cannot run (then estimates may be missing)."""

    recipe: Recipe
    mesh_sizes: Tuple[Tuple[str, int], ...]
    plan: object = None
    memory: Optional[MemoryEstimate] = None
    step: Optional[StepTimeEstimate] = None
    fit: Optional[Fit] = None
    rejected: Optional[str] = None
    warnings: Tuple[str, ...] = ()

    @property
    def label(self) -> str:
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh_sizes if s > 1) or "1 device"
        r, pipeline = self.recipe, self.recipe.dimension(Pipeline)
        pp = ""
        if self.plan is not None and is_pipelined(self.plan):
            pp = f" {pipeline.schedule.value}" + (f"×{pipeline.repeats}" if pipeline.schedule is Schedule.CIRCULAR
                                                 else "")
        return f"{r.name}[{mesh}] remat={r.remat.value} micro={batch_splits(r)}{pp}"

    def summary(self) -> Dict[str, object]:
        out = {"recipe": self.recipe.name, "mesh": dict(self.mesh_sizes), "remat": self.recipe.remat.value,
               "micro_batches": batch_splits(self.recipe), "compute_dtype": self.recipe.compute_dtype,
               "param_dtype": self.recipe.param_dtype}
        if "pp" in self.recipe.strategies:
            pipeline = self.recipe.dimension(Pipeline)
            out.update(schedule=pipeline.schedule.value, repeats=pipeline.repeats)
        if recipe_attention_kind(self.recipe) is not AttentionKind.DENSE:
            out["attention"] = recipe_attention_kind(self.recipe).value
        if self.rejected:
            out["rejected"] = self.rejected
        if self.memory is not None:
            out.update(memory_bytes=self.memory.total, fit=self.fit.value if self.fit else None)
        if self.step is not None:
            out.update(step_s=self.step.step_s, mfu=self.step.mfu, bound=self.step.bound.value)
            if self.plan is not None and pipeline_shape(self.plan) is not None:
                out["bubble"] = pipeline_shape(self.plan).bubble
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


def mesh_options(recipe: Recipe, num_devices: int) -> List[Dict[str, int]]:
    """Every assignment of sizes to the recipe's mesh axes whose product is ``num_devices``."""
    axes = [a for a, _ in recipe.mesh.ici]
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes) - 1):
        rest = num_devices // math.prod(sizes) if num_devices % math.prod(sizes) == 0 else 0
        if rest:
            out.append(dict(zip(axes, sizes + (rest,))))
    return out


def rule_warnings(cfg, plan, hw: Hardware, step: Optional[StepTimeEstimate] = None) -> List[str]:
    """The well-known rules, checked for one plan (empty when all hold). For any model: head counts
    are checked when ``cfg`` has them, the FSDP rule when the batch has a ``seq`` axis."""
    lay = layout_of(plan)
    out = []
    links = axis_links(lay, hw)
    for axis in lay.tensor_axes:
        if links.get(axis) is Link.SLOW:
            out.append(f"tensor parallelism over {lay.tensor} devices ({axis}) leaves the {hw.fast_domain}-device "
                       f"fast-link domain of {hw.name}: its per-layer all-reduces cross the slow links; keep "
                       f"tensor × inner axes ≤ {hw.fast_domain}")
    # only the all-to-all kinds split heads over the context axes (ring / all_gather keep them whole)
    att = resolved_step(plan).attention.kind.value
    ctx = lay.context if att == "ulysses" else lay.sizes.get("ulysses", 1) if att == "usp" else 1
    for what, heads in (("query heads", getattr(cfg, "n_heads", None)), ("kv heads", getattr(cfg, "n_kv_heads", None))):
        ways = lay.tensor * ctx
        if heads and ways > 1 and heads % ways:
            out.append(f"{what} ({heads}) not divisible by tensor × context = {lay.tensor} × {ctx}: their weights "
                       f"stay whole on every rank and the heads are padded or replicated (the plan's heads line "
                       f"says which and its bytes); pick tensor × context dividing {heads}")
    ex = expert_axes(plan)
    if ex and any(links.get(a) is Link.SLOW for a in ex):
        out.append(f"expert parallelism over {'×'.join(ex)}={lay.size(ex)} crosses the slow links of {hw.name}: "
                   f"every layer's token all-to-all (dispatch + combine, forward and backward) goes over them; keep "
                   f"expert × inner axes ≤ {hw.fast_domain} and shard the rest with data/FSDP or a pipeline"
                   + ("" if expert_exchange(plan).hierarchical or expert_exchange(plan).slices <= 1 else
                      ", or --all-to-all hierarchical (one DCN message per remote slice, tensor ranks' shares)"))
    if pipeline_shape(plan) is not None:
        bubble = bubble_warning(config_for(plan.recipe, plan.mesh_sizes))
        if bubble:
            out.append(bubble)
    fsdp_axes = cached(plan, "fsdp_axes", _fsdp_axes, layout_only=True)
    if fsdp_axes and _tokens(plan) is not None:
        g = lay.size(fsdp_axes)
        link = Link.SLOW if any(links.get(a) is Link.SLOW for a in fsdp_axes) else Link.FAST
        bw = hw.fast_link_bytes_per_s if link is Link.FAST else hw.slow_link_bytes_per_s
        c = 2 if lay.compute_dtype == "bfloat16" else 4
        need = hw.peak_flops * c / (2 * bw) * (g - 1) / g  # tokens/device with 2·W·tok/P ≥ W·c·(g-1)/g/bw
        have = _tokens(plan) // (lay.batch_split * lay.micro_batches)
        if have < need:
            out.append(f"FSDP over {'×'.join(sorted(fsdp_axes))}={g}: {have:,} tokens per device per micro-batch, "
                       f"but about {need:,.0f} are needed for a layer's forward compute to hide its weight "
                       f"all-gather on {hw.name} ({link.value} links); raise the batch, use fewer micro-batches, or "
                       f"shard less with FSDP (more data or tensor parallelism)")
    return out


def _fsdp_axes(plan) -> set:
    """Batch axes that shard some parameter (FSDP)."""
    batch = set(layout_of(plan).batch_axes)
    fsdp_axes = set()
    for leaf in plan.group("params"):
        for e in leaf.spec:
            fsdp_axes |= ({e} if isinstance(e, str) else set(e or ())) & batch
    return fsdp_axes


def _tokens(plan):
    """Tokens per step of a token batch (a ``seq`` axis), else ``None`` (the FSDP rule counts tokens)."""
    return cached(plan, "tokens", _tokens_of, layout_only=True)


def _tokens_of(plan):
    try:
        return plan.batch.batch_size * plan.batch.seq_len
    except MeshtrainError:
        return None


def evaluate(request: PlanRequest, recipe: Recipe, *, abstract=None, base_plan=None) -> Candidate:
    """Plan ``recipe`` (its mesh resolved on ``request.num_devices``) and estimate it."""
    import optax

    cfg, hw = request.model, request.hw()
    dtypes = request.dtypes(recipe)
    if any(getattr(recipe, k) != v for k, v in dtypes.items()):  # (else a copy equal to it)
        recipe = recipe.with_options(**dtypes)
    try:
        sizes = tuple(recipe.mesh.resolve(request.num_devices).items())
    except MeshtrainError as exc:
        return Candidate(recipe, (), rejected=str(exc))
    try:
        if base_plan is None:
            abstract = abstract or abstract_state(model_factory(cfg), optax.adamw(1e-3))
            mesh = recipe.mesh.abstract(request.num_devices)
            plan = make_plan(abstract, recipe, mesh, batch=BatchSpec(request.global_batch, request.tokens_seq))
        else:
            plan = plan_variant(base_plan, recipe)
            dp = layout_of(plan).batch_split
            batch_size = cached(plan, "batch_size", lambda p: p.batch.batch_size, layout_only=True)
            if batch_size % (dp * batch_splits(recipe)):
                raise ConfigError(f"batch size {batch_size} is not divisible by data-parallel size {dp} "
                                  f"× micro-batches {batch_splits(recipe)}")
    except MeshtrainError as exc:
        return Candidate(recipe, sizes, rejected=f"{type(exc).__name__}: {exc}")
    problem = pipeline_problem(plan, cfg)
    if problem:
        return Candidate(recipe, sizes, plan, rejected=f"pipeline: {problem}")
    memory = estimate_memory(plan, cfg, backend=backend_of(hw))
    fit = memory.verdict(hw.hbm_bytes)
    step = estimate_step_time(plan, cfg, hw)
    warnings = tuple(rule_warnings(cfg, plan, hw, step))
    rejected = None
    if fit is Fit.DOES_NOT_FIT:
        top = ", ".join(f"{c.value} {fmt_bytes(b, '.1f', 'GiB')}" for c, b in memory.largest(2))
        rejected = (f"does not fit: {fmt_bytes(memory.total, '.1f', 'GiB')} > "
                    f"{fmt_bytes(hw.hbm_bytes, '.1f', 'GiB')} ({top})")
    return Candidate(recipe, sizes, plan, memory, step, fit, rejected, warnings)


@dataclasses.dataclass(frozen=True)
class AutoResult:
    ranked: Tuple[Candidate, ...]
    rejected: Tuple[Candidate, ...]
    request: PlanRequest

    @property
    def winner(self) -> Candidate:
        if not self.ranked:
            reasons = sorted({c.rejected.split(":")[0] for c in self.rejected if c.rejected})
            raise ConfigError(
                f"no recipe and mesh fits {self.request.model.name} on {self.request.num_devices} × "
                f"{self.request.hw().name} with batch {self.request.global_batch}×{self.request.tokens_seq} "
                f"({len(self.rejected)} candidates rejected: {', '.join(reasons)}); use more devices, a shorter "
                f"--seq-len or a smaller --batch-size")
        return self.ranked[0]

    @property
    def why(self) -> str:
        w = self.winner
        others = [c for c in self.ranked[1:] if c.recipe.name != w.recipe.name]
        lines = [f"{w.label}: {w.step.step_s:.3g} s/step, MFU {w.step.mfu:.1%}, "
                 f"{fmt_bytes(w.memory.total, '.1f', 'GiB')} "
                 f"per device ({w.fit.value}); {w.step.bound.value}-bound"]
        if others:
            r = others[0]
            if r.step.step_s < w.step.step_s and r.fit is not w.fit:
                lines.append(f"ranked before the best other recipe, {r.label} ({r.step.step_s:.3g} s/step): that "
                             f"one is faster but {r.fit.value} ({fmt_bytes(r.memory.total, '.1f', 'GiB')}; "
                             f"layouts with 10 % "
                             f"headroom come first)")
            elif r.step.step_s <= w.step.step_s * 1.005:
                tie = ("ranked first for less memory" if w.memory.total < r.memory.total else
                       "the same estimate: either will do" if w.memory.total == r.memory.total else
                       "ranked first on its fit or step time")
                lines.append(f"beats the best other recipe, {r.label} ({r.step.step_s:.3g} s/step): a tie within "
                             f"0.5 %, {tie}")
            else:
                lines.append(f"beats the best other recipe, {r.label} ({r.step.step_s:.3g} s/step), mostly on "
                             f"{_main_difference(w, r)}")
        better = [c for c in self.rejected if c.step is not None and c.step.step_s < w.step.step_s]
        if better:
            b = min(better, key=lambda c: c.step.step_s)
            lines.append(f"faster layouts were dropped because they do not fit, e.g. {b.label}: {b.rejected}")
        lines += self._family_lines(w, others[0] if others else None)
        return "\n".join(lines)

    def _family_lines(self, w: Candidate, runner_up: Optional[Candidate]) -> List[str]:
        """Why the winner does or does not use expert parallelism (MoE models) or a pipeline: the best
        layout of that family and what it loses on, or why none of it was usable."""
        out = []
        families = []
        if getattr(self.request.model, "n_experts", 0):
            families.append(("expert-parallel (expert > 1)", _expert_degree))
        families.append(("pipelined (stage > 1)", lambda c: dict(c.mesh_sizes).get("stage", 1)))
        for name, degree in families:
            if degree(w) > 1:
                continue
            ranked = [c for c in self.ranked if degree(c) > 1]
            if ranked:
                b = ranked[0]
                if b is runner_up:
                    continue  # already named as the runner-up
                head = (f"best {name} layout: {b.label} ({b.step.step_s:.3g} s/step, MFU {b.step.mfu:.1%}, "
                        f"{fmt_bytes(b.memory.total, '.1f', 'GiB')})")
                if b.step.step_s < w.step.step_s and b.fit is not w.fit:
                    cap = self.request.hw().hbm_bytes
                    out.append(f"{head}: faster, but {b.fit.value} ({b.memory.total / cap:.0%} of the device's "
                               f"memory; the ranking puts layouts with 10 % headroom first)")
                else:
                    out.append(f"{head}: slower mostly on {_main_difference(w, b)}")
                continue
            tried = [c for c in self.rejected if degree(c) > 1]
            if not tried:
                if name.startswith("pipelined"):
                    continue  # no pp recipe searched
                out.append(f"no {name} layout was searched (recipes without `ep`, or the experts do not divide)")
                continue
            sized = [c for c in tried if c.memory is not None]
            b = min(sized, key=lambda c: c.memory.total) if sized else tried[0]
            out.append(f"no {name} layout is usable ({len(tried)} rejected); the closest, {b.label}: {b.rejected}")
        return out

    def rejection_counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for c in self.rejected:
            key = (c.rejected or "").split(":")[0]
            out[key] = out.get(key, 0) + 1
        return out


def plan_auto(request: PlanRequest, *, recipes: Optional[Sequence[Recipe]] = None) -> AutoResult:
    """Search recipes × mesh factorisations × remat × micro-batches; rank what fits by step time."""
    import optax

    if recipes is None:
        names = request.recipes or tuple(BUILTIN_RECIPES)
        recipes = [BUILTIN_RECIPES[n] if n in BUILTIN_RECIPES else _unknown(n) for n in names]
    abstract = abstract_state(model_factory(request.model), optax.adamw(1e-3))
    ranked, rejected = [], []
    seen = set()
    for base in recipes:
        for sizes in mesh_options(base, request.num_devices):
            if "pp" in base.strategies and sizes.get("stage", 1) == 1:
                continue  # one stage: the same layout as the recipe without pp, plus the schedule's costs
            recipe = dataclasses.replace(base, mesh=base.mesh.with_sizes(sizes))
            first = evaluate(request, recipe, abstract=abstract)
            if first.plan is None:
                rejected.append(first)
                continue
            dp = layout_of(first.plan).batch_split
            per_device = request.global_batch // dp
            variants, micros, why_not = _pipeline_variants(request, first, per_device)
            if why_not:
                rejected.append(dataclasses.replace(first, rejected=why_not))
                continue
            micros = list(request.micro_batches) or micros or [
                m for m in (1, 2, 4, 8, 16, 32, 64) if m <= min(per_device, request.max_micro_batches)
                and per_device % m == 0]
            for (schedule, repeats), remat, micro in itertools.product(variants, request.remats, micros):
                opts = {"remat": remat, batch_splits_option(recipe): micro}
                if schedule is not None:
                    opts.update(schedule=schedule, repeats=repeats)
                r = recipe.with_options(**opts)
                cand = evaluate(request, r, base_plan=first.plan)
                key = (cand.recipe.name, cand.mesh_sizes, remat, micro, schedule, repeats)
                if key in seen:
                    continue
                seen.add(key)
                (rejected if cand.rejected else ranked).append(cand)
    order = {Fit.FITS: 0, Fit.TIGHT: 1}
    best = min((c.step.step_s for c in ranked), default=1.0)
    # Within 0.5 % of each other, prefer the layout that leaves more memory free.
    ranked.sort(key=lambda c: (order.get(c.fit, 2), round(c.step.step_s / best * 200), c.memory.total))
    return AutoResult(tuple(ranked), tuple(rejected), request)


def _pipeline_variants(request: PlanRequest, first: Candidate, per_device: int):
    """``([(schedule, repeats), ...], micro-batch counts, why not)`` to try for ``first``'s layout: one
    ``(None, None)`` variant and no opinion on micro-batches without a pipeline; for a pipeline the
    request's schedules (circular with 2 repeats where ``L`` divides into ``2p`` groups) and micro-batch
    counts ``m >= p`` that divide the per-group batch (up to ``max(max_micro_batches, 4p)``). ``why not``:
    the reason the layout cannot pipeline at all (else ``None``)."""
    if not is_pipelined(first.plan):
        return [(None, None)], [], None
    p = first.plan.mesh_sizes.get("stage", 1)
    L = request.model.n_layers
    if L % p:
        return [], [], f"pipeline: the model has {L} layers, not divisible by {p} stages"
    limit = max(request.max_micro_batches, 4 * p)
    micros = [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if p <= m <= min(per_device, limit) and per_device % m == 0]
    if not micros and not request.micro_batches:
        return [], [], (f"pipeline: {p} stages need at least {p} micro-batches, but a data-parallel group has only "
                        f"{per_device} sequences; raise --batch-size")
    variants = []
    for name in request.schedules:
        schedule = Schedule(name)
        if schedule is Schedule.CIRCULAR:
            if L % (2 * p) == 0:
                variants.append((schedule, 2))
        else:
            variants.append((schedule, 1))
    return variants, micros, None


def _expert_degree(c: Candidate) -> int:
    """Devices the experts are split over in ``c`` (1 for a dense layout)."""
    if c.plan is None:
        rule = c.recipe.axis_rules().table("params").get("expert")
        sizes = dict(c.mesh_sizes)
        return math.prod(sizes.get(a, 1) for a in (rule.mesh_axes if rule else ()))
    return math.prod(c.plan.mesh_sizes.get(a, 1) for a in expert_axes(c.plan))


def _main_difference(w: Candidate, r: Candidate) -> str:
    """The step-time term on which ``r`` loses most to ``w``, with its size."""
    diffs = {"compute": r.step.compute_s - w.step.compute_s, "memory traffic": r.step.memory_s - w.step.memory_s,
             "exposed communication": r.step.exposed_comm_s - w.step.exposed_comm_s}
    term = max(diffs, key=lambda k: diffs[k])
    out = f"{term} ({diffs[term]:+.3g} s for it)"
    if term == "exposed communication" and r.step.axes:
        worst = max(r.step.axes, key=lambda a: a.exposed_seconds)
        out += f": {worst.axes} over {worst.link.value} links exposes {worst.exposed_seconds:.3g} s"
    return out


def _unknown(name: str):
    return get_recipe(name)
