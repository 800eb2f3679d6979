"""One decision per step: :func:`resolve_step` turns a plan and the platform its step compiles for into a
:class:`ResolvedStep` that says everything the step needs and why: the attention kind and kernel every layer
runs (with a reason such as ``"cudnn: cuDNN fused attention via jax.nn.dot_product_attention"``), the layer
loop, the gradient-accumulation steps, the pipeline schedule and its micro-batches, and the precision.

The step builder, the kernels (through :class:`meshtrain.annotate.StepContext`), the generation engine and the
planner read this one object, so a plan cannot describe a kernel that does not run. The flash backend's
eligibility rules (:func:`flash_backend`: cuDNN needs an NVIDIA GPU and bf16/fp16, packed documents need
Hopper; splash needs a TPU) live here and nowhere else. Example::

    step = resolve_step(plan, "tpu")         # or Target("gpu", (9, 0)); None: the plan's devices
    step.attention.backend                   # FlashBackend.SPLASH for a local-flash recipe
    step.attention.describe()                # "splash: Pallas TPU splash-attention kernel; per device ..."
    step.batch_splits                        # micro-batches per step (pp's, else grad_accum)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from meshtrain.annotate import StepContext
from meshtrain.errors import ConfigError
from meshtrain.kernels.bf16_rows import MIN_ELEMENTS as ROWS_MIN_ELEMENTS
from meshtrain.parallel.grad_compression import CompressionChoice
from meshtrain.parallel.grad_compression import resolve as resolve_compression
from meshtrain.parallel.heads import HeadLayout, plan_heads
from meshtrain.parallel.moe_exchange import ExpertExchange, resolve_exchange
from meshtrain.parallel.seq_layout import CONTEXT_KINDS, ContextLayout, context_layout
from meshtrain.recipes import AttentionKind, Fp8, LayerLoop, Remat, direct_layer_calls, resolve_layer_loop
from meshtrain.remat_policies import DEFAULT_OFFLOAD, parse_offload_names
from meshtrain.strategies import Context, Expert, FlashBackend, GradCompression, LoadBalance, Pipeline, Schedule

#: Packed documents on cuDNN: segments per row the ragged layout has room for (a static shape). A
#: step whose rows have more runs blockwise XLA on that device (:func:`flash_attention`). Room costs
#: memory: cuDNN keeps f32 softmax statistics of ``(b · CUDNN_MAX_SEGMENTS, n, T)`` per layer for the
#: backward (at head dim 64 and 32 segments, as many bytes as the layer's queries), so the bound is
#: a fixed count rather than a fraction of ``T``, which would make them grow as ``T²``. A row of
#: ``T`` tokens holds about ``T / L + 1`` documents of mean length ``L``: at 32, the fallback stays rare
#: for documents well above 64 tokens at ``T`` = 2,048 (256 at 8,192). ``flash_attention(..., max_segments=)``
#: overrides it per call.
CUDNN_MAX_SEGMENTS = 32
#: cuDNN's ragged layout (packed documents) needs this compute capability or newer (Hopper; JAX refuses it below).
PACKED_MIN_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class Target:
    """The platform a step is compiled for: ``platform`` (``cpu``, ``gpu``, ``tpu``; the planner's compile-only
    targets too) and, for a GPU, its ``compute_capability`` (``(9, 0)`` for H100; ``None``: unknown, taken as new
    enough). Example: ``Target("gpu", (8, 0))`` for an A100."""

    platform: str
    compute_capability: Optional[Tuple[int, int]] = None

    @classmethod
    def of(cls, target: "Target | str | None", mesh=None) -> "Target":
        """``target`` as a :class:`Target`: a string names the platform; ``None`` reads ``mesh``'s devices (a
        compile-only XLA:GPU device reports its target's capability), else JAX's default backend."""
        if isinstance(target, Target):
            return target
        device = _first_device(mesh)
        if target is None:
            target = getattr(device, "platform", None) or getattr(getattr(mesh, "abstract_device", None),
                                                                  "platform", None) or jax.default_backend()
        platform = str(getattr(target, "value", target)).lower()
        platform = "gpu" if platform == "cuda" else platform  # an NVIDIA device's own name (ROCm keeps "rocm")
        capability = parse_capability(getattr(device, "compute_capability", None)) if device is not None else None
        return cls(platform, capability if platform == "gpu" else None)

    @property
    def gpu(self) -> bool:
        return self.platform in ("gpu", "cuda")

    @property
    def name(self) -> str:
        """``cpu``, ``gpu`` or ``tpu`` (what the plan's kernel line prints)."""
        return "gpu" if self.gpu else self.platform


def _first_device(mesh):
    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        return mesh.devices.flat[0]
    return None


def parse_capability(text) -> Optional[Tuple[int, int]]:
    """``"9.0"`` → ``(9, 0)``; ``None`` for anything else (no attribute, a ROCm ``gfx90a``)."""
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def flash_backend(requested: "FlashBackend | str" = FlashBackend.AUTO, *, platform: Optional[str] = None,
                  dtype=jnp.float32, segmented: bool = False,
                  compute_capability: Optional[Tuple[int, int]] = None) -> Tuple[FlashBackend, str]:
    """``(backend, reason)`` for flash attention on ``platform`` (default: JAX's default backend): the one place
    the fused kernels' eligibility is decided.

    ``auto``: ``splash`` on TPU, ``cudnn`` on GPU for bf16/fp16 (``segmented``, packed documents: cuDNN's ragged
    layout, which needs ``compute_capability`` ≥ 9.0; ``None``, unknown, is taken as new enough), else ``xla``.
    Asking for a backend the platform lacks (``cudnn`` off GPU, or for packed documents below Hopper; ``splash``
    off TPU) raises a ``ConfigError`` naming the fix.
    Example: ``flash_backend("auto", platform="cpu")`` → ``(FlashBackend.XLA, "...")``.
    """
    try:
        requested = FlashBackend(getattr(requested, "value", requested))
    except ValueError:
        raise ConfigError(f"flash backend {requested!r}; use one of {[b.value for b in FlashBackend]}") from None
    platform = platform or jax.default_backend()
    gpu = platform in ("gpu", "cuda")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    old_gpu = segmented and compute_capability is not None and tuple(compute_capability) < PACKED_MIN_CAPABILITY
    sm = "sm{}{}".format(*compute_capability) if compute_capability is not None else ""
    if requested is FlashBackend.CUDNN and not gpu:
        raise ConfigError(f"flash backend 'cudnn' needs an NVIDIA GPU; this platform is {platform!r}: use "
                          f"flash_backend 'auto' or 'xla'")
    if requested is FlashBackend.CUDNN and old_gpu:
        raise ConfigError(f"flash backend 'cudnn' on packed documents (segment ids) needs cuDNN's ragged layout, "
                          f"Hopper (sm90) or newer; this GPU is {sm}: use flash_backend 'auto' or 'xla'")
    if requested is FlashBackend.SPLASH and platform != "tpu":
        raise ConfigError(f"flash backend 'splash' (Pallas TPU kernel) needs a TPU; this platform is {platform!r}: "
                          f"use flash_backend 'auto' or 'xla'")
    if requested is not FlashBackend.AUTO:
        return requested, f"{requested.value} (requested)"
    if platform == "tpu":
        return FlashBackend.SPLASH, "splash: Pallas TPU splash-attention kernel"
    if gpu and half and not segmented:
        return FlashBackend.CUDNN, "cudnn: cuDNN fused attention via jax.nn.dot_product_attention"
    if gpu and half and not old_gpu:
        return FlashBackend.CUDNN, (f"cudnn: cuDNN fused attention, packed documents as ragged segments (Hopper or "
                                    f"newer; a step with a row of more than {CUDNN_MAX_SEGMENTS} documents, "
                                    f"flash.CUDNN_MAX_SEGMENTS, runs blockwise XLA)")
    why = (f"packed documents need cuDNN's ragged layout, Hopper (sm90) or newer; this GPU is {sm}" if gpu and half
           else f"{jnp.dtype(dtype).name} on {platform}")
    return FlashBackend.XLA, f"xla: blockwise online softmax with recomputing backward ({why})"


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """The attention every layer of the stack runs (the layers are identical, so one choice serves them all).

    ``kind``: the recipe's (:class:`AttentionKind`); ``layout``: how a context kind lays the sequence on the mesh
    (``layout.kind`` is what runs: ``usp`` over a size-1 axis runs ``ring`` or ``ulysses``; a context kind whose
    axes are all size 1 runs ``flash`` on each device); ``backend``: the flash kernel inside (``None`` for dense
    attention, or when ``refused`` says why the requested one cannot run here); ``segmented``: whether the
    decision assumed packed documents (segment ids); ``reason`` / ``where``: what the plan's kernel line prints.
    """

    kind: AttentionKind
    layout: ContextLayout
    backend: Optional[FlashBackend]
    reason: str
    where: str
    segmented: bool = False
    refused: Optional[str] = None

    @property
    def context_kernel(self) -> bool:
        """Whether the step runs a context-parallel kernel under ``shard_map`` (a sharded sequence)."""
        return self.layout.sharded

    @property
    def fused(self) -> bool:
        """Whether a fused kernel (cuDNN or splash) runs: its custom call is in the compiled step."""
        return self.backend in (FlashBackend.CUDNN, FlashBackend.SPLASH)

    def describe(self) -> str:
        """``"cudnn: cuDNN fused attention ...; per device under shard_map ..."`` (or ``"refused: ..."``)."""
        return f"refused: {self.refused}" if self.refused else f"{self.reason}{'; ' if self.where else ''}{self.where}"

    def check(self) -> None:
        """Raise the ``ConfigError`` a refused backend carries (the kernels call this before running)."""
        if self.refused:
            raise ConfigError(self.refused)


class DecodeMatmul(str, enum.Enum):
    """How a generation step multiplies by its layers' weights. ``xla``: XLA's dot (on XLA:CPU a bf16 weight is
    converted to an f32 copy first). ``bf16_rows``: bf16 weights stored ``(out, in)`` and multiplied as stored by
    :mod:`meshtrain.kernels.bf16_rows` (half the bytes a decode step reads; XLA:CPU, 1 device, bf16 weights)."""

    XLA = "xla"
    BF16_ROWS = "bf16_rows"
    #: the whole decode step one C++ call (:mod:`meshtrain.kernels.decode_step`): f32 or small bf16 Llama-shaped
    #: models on 1 CPU device (small: XLA's ~81 kernels per step bound it; larger: its bytes, read on a thread per core)
    FUSED_STEP = "fused_step"


@dataclasses.dataclass(frozen=True)
class ResolvedStep:
    """Everything a step needs, decided once by :func:`resolve_step` (see the module docstring).

    ``target``: the platform compiled for; ``attention``: the kernel every layer runs; ``remat``, ``layer_loop``,
    ``scan_unroll``: the layer stack (``loop_for(n_layers)`` resolves ``auto``); ``heads``: how attention heads lie
    over ``tensor``; ``grad_accum``: accumulation
    steps (1 under a pipeline); ``schedule``, ``pipeline_micro_batches``, ``repeats``: the pipeline's (``None`` /
    1 / 1 without one); ``param_dtype`` / ``compute_dtype``: precision; ``offloaded``: the activations
    ``Remat.OFFLOAD`` keeps in host memory. (FP8 is not here: it wraps the model factory before a plan exists.)"""

    target: Target
    attention: AttentionChoice
    remat: Remat
    layer_loop: LayerLoop
    scan_unroll: int
    grad_accum: int
    schedule: Optional[Schedule]
    pipeline_micro_batches: int
    repeats: int
    param_dtype: str
    compute_dtype: str
    #: the activation names ``Remat.OFFLOAD`` keeps in host memory (the recipe's ``offload_activations``)
    offloaded: Tuple[str, ...] = DEFAULT_OFFLOAD
    #: attention heads over ``tensor`` (:mod:`meshtrain.parallel.heads`): padded, replicated or split; ``None``
    #: for a model without ``heads``
    heads: Optional[HeadLayout] = None
    #: how expert parallelism exchanges tokens (:mod:`meshtrain.parallel.moe_exchange`): flat, or hierarchical over
    #: an expert axis that spans slices; decided on the plan's own mesh sizes and DCN layout
    expert_exchange: ExpertExchange = ExpertExchange()
    #: the gradient reduction over `data` across DCN (:mod:`meshtrain.parallel.grad_compression`)
    grad_compression: CompressionChoice = CompressionChoice(GradCompression.NONE)
    #: generation only (:meth:`for_generation`): the layers' matmuls; training always multiplies with XLA's dot
    decode_matmul: DecodeMatmul = DecodeMatmul.XLA
    #: the recipe's FP8 scaling (``none``: bf16/f32 matmuls); a scaled stack stays a scan (:func:`direct_layer_calls`)
    fp8: Fp8 = Fp8.NONE

    @property
    def batch_splits(self) -> int:
        """Micro-batches one step splits the batch into: the pipeline's, else the accumulation steps."""
        return self.pipeline_micro_batches if self.schedule is not None else self.grad_accum

    def loop_for(self, n_layers: int) -> Tuple[LayerLoop, int]:
        """``(SCAN or UNROLLED, layers per iteration)`` for a stack of ``n_layers`` (:func:`resolve_layer_loop`)."""
        return resolve_layer_loop(self.layer_loop, n_layers, self.remat, self.scan_unroll)

    def direct_layer_calls(self, n_layers: int) -> bool:
        """Whether the step runs a stack of ``n_layers`` as direct per-layer calls (:func:`direct_layer_calls`):
        each FSDP weight is then gathered once per step, the backward reusing the forward's gather."""
        return direct_layer_calls(self.layer_loop, n_layers, self.remat, self.scan_unroll, self.fp8)

    def for_generation(self, weights: str = "none", devices: int = 1, layered: bool = False,
                       kernel_ready: Callable[[], bool] = lambda: False, prefer: Optional[str] = None,
                       largest_matmul: int = 0, step_kernel_ready: Callable[[], bool] = lambda: False,
                       step_kernel_model: Optional[str] = "no model given") -> "ResolvedStep":
        """The step the generation engine runs: no remat (nothing to differentiate), dense attention over the
        KV cache (decode attends one token to the cache; prefill writes the cache the same way), and its
        :class:`DecodeMatmul`: ``bf16_rows`` for ``weights="bf16"`` on XLA:CPU on 1 device with the layers
        stored one array per layer (``layered``: the compiled decode loop, weights on the device), a layer's
        largest projection of at least :data:`~meshtrain.kernels.bf16_rows.MIN_ELEMENTS` weights (``largest_matmul``;
        below it the kernel's call costs more than the bytes it saves: ``tiny`` decodes 2x slower with it), when
        ``kernel_ready()`` (called only then: it builds the kernel) says the kernel is built; else ``xla``.
        ``prefer="xla"`` keeps XLA's dot (the reference the kernel is tested and benchmarked against).
        ``fused_step`` (the whole decode step one call, :mod:`meshtrain.kernels.decode_step`): f32 weights and
        compute at any size (a larger model's step runs on a thread per core over weights stored ``(out, in)``),
        or bf16 weights with every projection *below* that size (a small model: the step is bound by XLA's kernel
        count), on XLA:CPU on 1 device, ``layered``, ``step_kernel_model`` ``None`` (the kernel's
        :func:`~meshtrain.kernels.decode_step.unsupported` of the model: else why not) and ``step_kernel_ready()``.
        Example: ``resolve_step(plan).for_generation("bf16", plan.mesh.size, True, kernel_ready)``."""
        dense = AttentionChoice(AttentionKind.DENSE, ContextLayout(AttentionKind.DENSE), None,
                                "dense (generation: XLA dot-product attention over the KV cache)", "partitioned by XLA")
        if prefer not in (None, *(m.value for m in DecodeMatmul)):
            raise ConfigError(f"decode matmul {prefer!r}: use one of {[m.value for m in DecodeMatmul]} (or leave it "
                              f"unset: chosen by platform and weights)")
        choice = DecodeMatmul.XLA
        f32 = weights == "none" and self.compute_dtype == "float32"
        # f32 at any size (a larger model's step runs on one thread per core: decode_step.team_size); bf16 below the
        # row kernel's size (above it bf16_rows reads the same 2 bytes per weight)
        fused = (self.target.platform == "cpu" and (f32 or (weights == "bf16" and largest_matmul < ROWS_MIN_ELEMENTS))
                 and devices == 1 and layered and step_kernel_model is None)
        if prefer in (None, DecodeMatmul.FUSED_STEP.value) and fused and step_kernel_ready():
            choice = DecodeMatmul.FUSED_STEP
        elif prefer == DecodeMatmul.FUSED_STEP.value:
            raise ConfigError(f"decode matmul 'fused_step' needs f32 (weights and compute), or bf16 weights with "
                              f"every projection under {ROWS_MIN_ELEMENTS} weights (got {largest_matmul}), on 1 "
                              f"CPU device with the compiled decode loop, a model the kernel supports (got: "
                              f"{step_kernel_model or 'ok'}) "
                              f"and a C++ compiler (got weights {weights!r}, compute {self.compute_dtype}, {devices} "
                              f"device(s), platform {self.target.platform!r}, layered {layered}); leave it unset")
        elif prefer != DecodeMatmul.XLA.value:
            eligible = (self.target.platform == "cpu" and weights == "bf16" and devices == 1 and layered
                        and largest_matmul >= ROWS_MIN_ELEMENTS)
            if eligible and kernel_ready():
                choice = DecodeMatmul.BF16_ROWS
            elif prefer is not None:
                raise ConfigError(f"decode matmul 'bf16_rows' needs bf16 weights on 1 CPU device with the compiled "
                                  f"decode loop (got weights {weights!r}, {devices} device(s), platform "
                                  f"{self.target.platform!r}, layered {layered}, largest projection {largest_matmul} "
                                  f"weights, at least {ROWS_MIN_ELEMENTS}) and a C++ compiler for the kernel; "
                                  f"leave it unset to let the engine choose")
        return dataclasses.replace(self, attention=dense, remat=Remat.NONE, decode_matmul=choice)


def packed_batch(plan) -> bool:
    """Whether the plan's batch carries segment ids (packed documents); a plan without a batch is taken as packed."""
    return plan.batch is None or any(path.split("/")[-1] == "segment_ids" for path, _ in plan.batch.leaves())


def resolve_step(plan, target: "Target | str | None" = None, *, mesh=None) -> ResolvedStep:
    """The one :class:`ResolvedStep` of ``plan`` compiled for ``target`` (a :class:`Target`, ``"cpu"`` /
    ``"gpu"`` / ``"tpu"``, or ``None``: the platform of the plan's devices). ``mesh`` replaces the plan's mesh (the
    planner traces the step on a 1-device mesh, where no context axis shards the sequence). Pure: it reads the
    recipe, the rules, the mesh sizes and the batch layout, and builds nothing."""
    recipe = plan.recipe
    mesh = plan.mesh if mesh is None else mesh
    target = Target.of(target, mesh)
    sizes = dict(plan.mesh_sizes) if mesh is plan.mesh else dict(mesh.shape)
    pipeline = recipe.dimension(Pipeline)
    attention = resolve_attention(recipe_attention_kind(recipe), recipe.dimension(Context), plan.rules, sizes, target,
                                  packed_batch(plan), recipe.compute_dtype)
    return ResolvedStep(
        target=target, attention=attention, remat=recipe.remat, layer_loop=recipe.layer_loop,
        scan_unroll=recipe.scan_unroll, grad_accum=1 if pipeline else recipe.grad_accum,
        schedule=pipeline.schedule if pipeline else None,
        pipeline_micro_batches=pipeline.micro_batches if pipeline else 1,
        repeats=pipeline.repeats if pipeline else 1, param_dtype=recipe.param_dtype,
        compute_dtype=recipe.compute_dtype, offloaded=parse_offload_names(recipe.offload_activations),
        heads=plan_heads(plan, sizes),
        expert_exchange=resolve_exchange(recipe.dimension(Expert), plan.rules, recipe.mesh, dict(plan.mesh_sizes)),
        grad_compression=resolve_compression(recipe, dict(plan.mesh_sizes)), fp8=recipe.fp8)


def recipe_attention_kind(recipe) -> AttentionKind:
    """A recipe's attention kind: its ``cp`` dimension's kind, else its ``local_attention``."""
    context = recipe.dimension(Context)
    return AttentionKind(context.kind.value if context is not None else recipe.local_attention.value)


def resolve_attention(kind: AttentionKind, context: Optional[Context], rules, mesh_sizes: Mapping[str, int],
                      target: Target, segmented: bool, dtype) -> AttentionChoice:
    """The :class:`AttentionChoice` for attention ``kind`` with the recipe's ``cp`` dimension ``context`` (or
    ``None``) under activation ``rules`` on a mesh of ``mesh_sizes``, for ``target``, on a batch with or without
    segment ids (``segmented``), in compute ``dtype``."""
    kind = AttentionKind(kind)
    requested = context.flash_backend if context is not None else FlashBackend.AUTO
    balance = context.load_balance if context is not None else LoadBalance.ZIGZAG
    layout = context_layout(kind, rules, dict(mesh_sizes), balance)
    runs = layout.kind if layout.sharded else kind
    if runs is AttentionKind.DENSE:
        return AttentionChoice(kind, layout, None, "dense (XLA dot-product attention)", "")
    if layout.sharded and runs is not AttentionKind.ULYSSES:
        return AttentionChoice(kind, layout, FlashBackend.XLA, (
            f"{runs.value} context attention under shard_map, blockwise XLA flash blocks inside (its chunks' "
            f"positions are permuted, which the fused kernels do not take)"), "", segmented)
    if kind in CONTEXT_KINDS and not layout.sharded:
        requested = FlashBackend.XLA  # one device holds the whole sequence: the context kinds' measured local kernel
    elif runs is AttentionKind.ULYSSES and requested is FlashBackend.AUTO:
        requested = FlashBackend.XLA  # whole sequences per head group: the context kernels' local default
    where = "inside the ulysses all-to-all's shard_map" if runs is AttentionKind.ULYSSES else ""
    capability = target.compute_capability if target.gpu else None
    try:
        backend, why = flash_backend(requested, platform=target.platform, dtype=dtype, segmented=segmented,
                                     compute_capability=capability)
    except ConfigError as exc:
        return AttentionChoice(kind, layout, None, "", where, segmented, refused=str(exc))
    where = where or ("per device under shard_map over the batch and head split" if backend is not FlashBackend.XLA
                      else "partitioned by XLA")
    return AttentionChoice(kind, layout, backend, why, where, segmented)


def active_attention(ctx, kind: Optional[AttentionKind] = None, *, dtype, segmented: bool) -> AttentionChoice:
    """The attention the kernels run inside step context ``ctx``: its resolved step's choice, or (a context built
    by hand, or ``kind`` other than the step's) :func:`resolve_attention` for the call's ``dtype`` and segment ids."""
    resolved = ctx.resolved
    if resolved is not None and (kind is None or AttentionKind(kind) is resolved.attention.kind):
        return resolved.attention
    kind = ctx.attention if kind is None else kind
    return resolve_attention(kind, ctx.dimension(Context), ctx.rules, dict(ctx.mesh.shape), Target.of(None, ctx.mesh),
                             segmented, dtype)


def step_context_for(plan, mesh=None) -> StepContext:
    """The one step context of ``plan`` (its resolved step, rules, mesh and dimensions) for the train step, the
    eval step and the planner's compiled estimate; ``mesh`` replaces the plan's (the planner traces on a 1-device
    abstract mesh)."""
    mesh = plan.mesh if mesh is None else mesh
    step = resolve_step(plan, mesh=mesh)
    r = plan.recipe
    return StepContext(mesh, plan.rules, r.replicate_ok(), step.remat, step.attention.kind,
                       tuple(r.strategies), step.layer_loop, step.scan_unroll, resolved=step,
                       offloaded=step.offloaded)


def batch_splits(recipe) -> int:
    """Micro-batches one step of ``recipe`` splits the batch into: its pipeline's (``pp``'s ``micro_batches``),
    else its ``grad_accum`` (what :attr:`ResolvedStep.batch_splits` reads, for callers holding only a recipe)."""
    pipeline = recipe.dimension(Pipeline)
    return pipeline.micro_batches if pipeline is not None else recipe.grad_accum


def batch_splits_option(recipe) -> str:
    """The :meth:`~meshtrain.Recipe.with_options` name that sets :func:`batch_splits` for ``recipe``."""
    return "pipeline_micro_batches" if recipe.dimension(Pipeline) is not None else "grad_accum"
