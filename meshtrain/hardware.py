"""Hardware profiles: peak bf16 FLOP/s, HBM size and bandwidth, fast-link and slow-link bandwidths,
each figure with its source.

Example::

    hw = get_hardware("tpu-v5p")
    hw.peak_flops, hw.hbm_bytes, hw.fast_link_bytes_per_s, hw.fast_domain
    for field, source in hw.sources.items(): print(field, source)
    cpu = get_hardware("cpu")            # measured on this machine (timed matmul, copy, all-reduce)

Conventions (used by :mod:`meshtrain.analysis.steptime`):

* ``peak_flops``: dense bf16 matmul FLOP/s per chip (no sparsity).
* ``fast_link_bytes_per_s``: bytes/s one device can send in a collective over the fast links
  (NVLink, TPU ICI), i.e. half the published *bidirectional* per-chip figure.
* ``slow_link_bytes_per_s``: bytes/s per device across nodes / slices (InfiniBand NIC per GPU,
  TPU DCN per chip), one direction.
* ``fast_domain``: how many devices share the fast links (8 GPUs in an HGX node; a TPU slice).
* ``*_latency_s``: per-hop latency of a collective step. These are order-of-magnitude
  assumptions (vendors do not publish them) and say so in ``sources``.

Next: :func:`meshtrain.analysis.steptime.estimate_step_time` with a hardware profile.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Dict, Mapping, Optional

from meshtrain.errors import ConfigError

GB = 1e9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator's figures (per chip). ``sources`` maps each field to where it comes from."""

    name: str
    description: str
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    fast_link_bytes_per_s: float
    slow_link_bytes_per_s: float
    fast_domain: int
    fast_latency_s: float
    slow_latency_s: float
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    shared_host: int = 1  # simulated devices that share one host's cores and memory (cpu profile)

    def to_dict(self) -> Dict[str, object]:
        return {f.name: (dict(getattr(self, f.name)) if f.name == "sources" else getattr(self, f.name))
                for f in dataclasses.fields(self)}


_NV_LAT = "assumed: ~5 µs per NVLink collective step, ~10 µs per InfiniBand step (order of magnitude)"
_TPU_LAT = "assumed: ~2 µs per ICI collective step, ~30 µs per DCN step (order of magnitude)"


def _gpu(name, desc, tflops, hbm_gb, hbm_tbs, nvlink_bidir_gbs, ib_gbit, srcs) -> Hardware:
    return Hardware(name, desc, tflops * 1e12, hbm_gb * GB, hbm_tbs * 1e12, nvlink_bidir_gbs / 2 * GB,
                    ib_gbit / 8 * GB, 8, 5e-6, 10e-6, {**srcs, "fast_domain": "8 GPUs per HGX/DGX node",
                                                       "fast_latency_s": _NV_LAT, "slow_latency_s": _NV_LAT})


def _tpu(name, desc, tflops, hbm, hbm_gbs, ici_bidir_gbs, dcn_gbit, domain, srcs) -> Hardware:
    return Hardware(name, desc, tflops * 1e12, hbm, hbm_gbs * GB, ici_bidir_gbs / 2 * GB, dcn_gbit / 8 * GB,
                    domain, 2e-6, 30e-6, {**srcs, "fast_latency_s": _TPU_LAT, "slow_latency_s": _TPU_LAT})


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"
_B200 = "NVIDIA HGX B200 / DGX B200 datasheet (per-GPU share of the 8-GPU board)"
_V4 = "https://cloud.google.com/tpu/docs/v4"
_V5E = "https://cloud.google.com/tpu/docs/v5e"
_V5P = "https://cloud.google.com/tpu/docs/v5p"
_V6E = "https://cloud.google.com/tpu/docs/v6e"

PROFILES: Dict[str, Hardware] = {h.name: h for h in [
    _gpu("h100", "NVIDIA H100 SXM5 80GB, 8 per node, NVLink 4, 400 Gb/s NDR InfiniBand per GPU",
         989, 80, 3.35, 900, 400,
         {"peak_flops": f"{_H100}: BF16 dense 989 TFLOPS (1,979 with sparsity)",
          "hbm_bytes": f"{_H100}: 80 GB HBM3", "hbm_bytes_per_s": f"{_H100}: 3.35 TB/s",
          "fast_link_bytes_per_s": f"{_H100}: NVLink 900 GB/s bidirectional → 450 GB/s per direction",
          "slow_link_bytes_per_s": "DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU → 50 GB/s"}),
    _gpu("h200", "NVIDIA H200 SXM 141GB, 8 per node, NVLink 4, 400 Gb/s InfiniBand per GPU",
         989, 141, 4.8, 900, 400,
         {"peak_flops": f"{_H200}: BF16 dense 989 TFLOPS (1,979 with sparsity)",
          "hbm_bytes": f"{_H200}: 141 GB HBM3e", "hbm_bytes_per_s": f"{_H200}: 4.8 TB/s",
          "fast_link_bytes_per_s": f"{_H200}: NVLink 900 GB/s bidirectional → 450 GB/s per direction",
          "slow_link_bytes_per_s": "HGX H200 reference: one 400 Gb/s NIC per GPU → 50 GB/s"}),
    _gpu("a100", "NVIDIA A100 SXM4 80GB, 8 per node, NVLink 3, 200 Gb/s HDR InfiniBand per GPU",
         312, 80, 2.039, 600, 200,
         {"peak_flops": f"{_A100}: BF16 dense 312 TFLOPS (624 with sparsity)",
          "hbm_bytes": f"{_A100}: 80 GB HBM2e", "hbm_bytes_per_s": f"{_A100}: 2,039 GB/s",
          "fast_link_bytes_per_s": f"{_A100}: NVLink 600 GB/s bidirectional → 300 GB/s per direction",
          "slow_link_bytes_per_s": "DGX A100: one 200 Gb/s ConnectX-6 NIC per GPU → 25 GB/s"}),
    _gpu("b200", "NVIDIA B200 (HGX B200), 8 per node, NVLink 5, 400 Gb/s InfiniBand per GPU",
         2250, 180, 7.7, 1800, 400,
         {"peak_flops": f"{_B200}: FP16/BF16 36 PFLOPS sparse per 8 GPUs → 2.25 PFLOPS dense per GPU",
          "hbm_bytes": f"{_B200}: 1,440 GB HBM3e per 8 GPUs → 180 GB",
          "hbm_bytes_per_s": f"{_B200}: 62 TB/s per 8 GPUs → 7.7 TB/s",
          "fast_link_bytes_per_s": f"{_B200}: NVLink 5 1.8 TB/s bidirectional → 900 GB/s per direction",
          "slow_link_bytes_per_s": "DGX B200: one 400 Gb/s ConnectX-7 NIC per GPU → 50 GB/s"}),
    _tpu("tpu-v4", "Google Cloud TPU v4 (3D torus, 4096-chip pods)", 275, 32 * GIB, 1200, 2 * 1.1e15 / 4096 / GB,
         25, 4096,
         {"peak_flops": f"{_V4}: 275 TFLOPS (bf16)", "hbm_bytes": f"{_V4}: 32 GiB HBM2",
          "hbm_bytes_per_s": f"{_V4}: 1200 GBps",
          "fast_link_bytes_per_s": f"{_V4}: all-reduce bandwidth 1.1 PB/s per 4096-chip pod → 268 GB/s per chip",
          "slow_link_bytes_per_s": "assumed: 25 Gb/s DCN per chip (not published on the v4 page)",
          "fast_domain": f"{_V4}: 4096 chips per pod (ICI)"}),
    _tpu("tpu-v5e", "Google Cloud TPU v5e (2D torus, 256-chip pods)", 197, 16 * GB, 819, 400, 25, 256,
         {"peak_flops": f"{_V5E}: 197 TFLOPS (bf16)", "hbm_bytes": f"{_V5E}: 16 GB HBM2",
          "hbm_bytes_per_s": f"{_V5E}: 819 GBps",
          "fast_link_bytes_per_s": f"{_V5E}: ICI 400 GBps bidirectional per chip → 200 GB/s",
          "slow_link_bytes_per_s": f"{_V5E}: 2 × 100 Gbps NIC per 8-chip host → 25 Gb/s per chip",
          "fast_domain": f"{_V5E}: 256 chips per pod (ICI)"}),
    _tpu("tpu-v5p", "Google Cloud TPU v5p (3D torus, up to 8960 chips)", 459, 95 * GIB, 2765, 1200, 50, 8960,
         {"peak_flops": f"{_V5P}: 459 TFLOPS (bf16)", "hbm_bytes": f"{_V5P}: 95 GiB HBM2e",
          "hbm_bytes_per_s": f"{_V5P}: 2765 GBps",
          "fast_link_bytes_per_s": f"{_V5P}: ICI 1200 GBps bidirectional per chip → 600 GB/s",
          "slow_link_bytes_per_s": f"{_V5P}: DCN 50 Gbps per chip", "fast_domain": f"{_V5P}: 8960 chips per pod"}),
    _tpu("tpu-v6e", "Google Cloud TPU v6e Trillium (2D torus, 256-chip pods)", 918, 32 * GB, 1638, 800, 25, 256,
         {"peak_flops": f"{_V6E}: 918 TFLOPS (bf16)", "hbm_bytes": f"{_V6E}: 32 GB",
          "hbm_bytes_per_s": f"{_V6E}: 1638 GBps",
          "fast_link_bytes_per_s": f"{_V6E}: ICI 800 GBps bidirectional per chip → 400 GB/s",
          "slow_link_bytes_per_s": "assumed: 25 Gb/s DCN per chip, as v5e (not published on the v6e page)",
          "fast_domain": f"{_V6E}: 256 chips per pod (ICI)"}),
]}

ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "trillium": "tpu-v6e",
           "h100-sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100"}


def hardware_names():
    return tuple(PROFILES) + ("cpu",)


def get_hardware(name: "str | Hardware", *, num_devices: Optional[int] = None) -> Hardware:
    """A profile by name (``h100``, ``h200``, ``a100``, ``b200``, ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p``,
    ``tpu-v6e``, or ``cpu``: measured here, shared by ``num_devices`` simulated devices)."""
    if isinstance(name, Hardware):
        return name
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        return cpu_profile(num_devices or _cpu_device_count())
    try:
        return PROFILES[key]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}") from None


def _cpu_device_count() -> int:
    import jax

    return len(jax.devices("cpu"))


@functools.lru_cache(maxsize=None)
def measure_cpu() -> Dict[str, float]:
    """Time this host (≈1–2 s): f32 matmul FLOP/s, copy bandwidth, and the cost of an all-reduce
    over the simulated CPU devices (``latency_s`` per op and ``bytes_per_s`` per device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def best(fn, *args, reps=5):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    cpu0 = jax.devices("cpu")[0]
    n = 1024
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu0)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * n ** 3 / best(matmul, a)
    big = jax.device_put(jnp.ones((8 * 2 ** 20,), jnp.float32), cpu0)  # 32 MiB
    copy = jax.jit(lambda x: x * 1.5)
    mem_bw = 2 * big.nbytes / best(copy, big)  # read + write
    devices = jax.devices("cpu")
    out = {"flops": flops, "mem_bytes_per_s": mem_bw, "latency_s": 0.0, "link_bytes_per_s": mem_bw, "devices": 1}
    if len(devices) > 1:
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))

        def allreduce(x):
            return jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=jax.sharding.PartitionSpec("d"),
                                 out_specs=jax.sharding.PartitionSpec("d"))(x)

        f = jax.jit(allreduce)
        k = len(devices)
        small = jax.device_put(jnp.ones((k * 8,), jnp.float32), spec)
        latency = best(f, small, reps=10)
        size = 2 ** 20  # 4 MiB per device
        large = jax.device_put(jnp.ones((k * size,), jnp.float32), spec)
        t_large = best(f, large)
        wire = 2 * (k - 1) / k * size * 4  # ring all-reduce bytes per device
        out.update(latency_s=latency, link_bytes_per_s=wire / max(t_large - latency, 1e-9), devices=k)
    return out


def cpu_profile(num_devices: int) -> Hardware:
    """The ``cpu`` profile: this host's measured figures, divided among ``num_devices`` simulated
    devices that share its cores and memory (each gets ``1/num_devices`` of the FLOP/s and bandwidth)."""
    m = measure_cpu()
    n = max(int(num_devices), 1)
    src = "measured on this host by meshtrain.analysis.hardware.measure_cpu()"
    return Hardware(
        "cpu", f"this CPU host shared by {n} simulated devices", m["flops"] / n, float("inf"),
        m["mem_bytes_per_s"] / n, m["link_bytes_per_s"], m["link_bytes_per_s"], n, m["latency_s"], m["latency_s"],
        {"peak_flops": f"{src}: timed 1024² f32 matmul = {m['flops'] / 1e9:.1f} GFLOP/s per host, ÷{n} devices",
         "hbm_bytes": "host RAM: not a per-device limit (reported as unlimited)",
         "hbm_bytes_per_s": f"{src}: timed 32 MiB scale-copy = {m['mem_bytes_per_s'] / 1e9:.1f} GB/s per host, ÷{n}",
         "fast_link_bytes_per_s": f"{src}: timed {m['devices']}-device psum of 4 MiB per device (ring bytes / time)",
         "slow_link_bytes_per_s": "same as fast links (one host)",
         "fast_domain": "all simulated devices", "fast_latency_s": f"{src}: timed psum of 32 bytes per device",
         "slow_latency_s": "same as fast"},
        shared_host=n)


# ---- XLA scheduling flags per backend --------------------------------------------------------
#
# What makes collectives overlap compute. XLA reads these once, when its backend starts, from
# ``XLA_FLAGS`` (GPU) or ``LIBTPU_INIT_ARGS`` (TPU); the CPU backend needs none. The GPU set follows
# the JAX GPU performance guide (latency-hiding scheduler, pipelined and combined collectives); the
# TPU set is the async-collective-fusion group MaxText launches its TPU runs with. Every GPU flag is
# checked against this jaxlib by tests/test_xla_flags.py (an unknown flag aborts XLA at start-up).

#: backend -> (environment variable, ((flag, value, why), ...)).
SCHEDULING_FLAGS: Dict[str, tuple] = {
    "cpu": ("XLA_FLAGS", ()),
    "gpu": ("XLA_FLAGS", (
        ("xla_gpu_enable_latency_hiding_scheduler", "true", "schedule async collectives behind compute"),
        ("xla_gpu_enable_highest_priority_async_stream", "true", "collectives on a high-priority stream"),
        ("xla_gpu_all_gather_combine_threshold_bytes", "134217728", "combine FSDP gathers up to 128 MiB"),
        ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728", "combine gradient reduce-scatters"),
        ("xla_gpu_all_reduce_combine_threshold_bytes", "134217728", "combine DP all-reduces"),
        ("xla_gpu_enable_pipelined_all_gather", "true", "prefetch the next layer's weights inside the scan"),
        ("xla_gpu_enable_pipelined_reduce_scatter", "true", "overlap a layer's gradient reduce-scatter"),
        ("xla_gpu_enable_pipelined_all_reduce", "true", "overlap a layer's gradient all-reduce"),
        ("xla_gpu_enable_while_loop_double_buffering", "true", "double-buffer the layer scan's carries"),
        ("xla_gpu_enable_all_gather_combine_by_dim", "false", "combine gathers of different dimensions too"),
        ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false", "combine reduce-scatters of different dims"),
    )),
    "tpu": ("LIBTPU_INIT_ARGS", (
        ("xla_tpu_enable_async_collective_fusion", "true", "run collectives asynchronously, fused"),
        ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true", "include FSDP all-gathers"),
        ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true", "overlap across several ops"),
        ("xla_tpu_overlap_compute_collective_tc", "true", "overlap on the TensorCore"),
        ("xla_enable_async_all_gather", "true", "async all-gather"),
        ("xla_tpu_enable_data_parallel_all_reduce_opt", "true", "overlap the DP gradient all-reduce"),
        ("xla_tpu_data_parallel_opt_different_sized_ops", "true", "... for gradients of different sizes"),
    )),
}


def backend_of_hardware(hw: "Hardware | str") -> str:
    """``cpu``, ``gpu`` or ``tpu`` for a hardware profile (or its name)."""
    name = hw if isinstance(hw, str) else hw.name
    name = ALIASES.get(name.lower(), name.lower())
    return "cpu" if name == "cpu" else ("tpu" if name.startswith("tpu") else "gpu")


def scheduling_flags(backend: str) -> Dict[str, str]:
    """``{environment variable: flags}`` meshtrain sets for ``backend`` (``cpu``/``gpu``/``tpu``)."""
    if backend not in SCHEDULING_FLAGS:
        raise ConfigError(f"unknown backend {backend!r}; use one of {sorted(SCHEDULING_FLAGS)}")
    var, flags = SCHEDULING_FLAGS[backend]
    return {var: " ".join(f"--{f}={v}" for f, v, _ in flags)} if flags else {}


def detect_backend(environ: Optional[Mapping[str, str]] = None) -> str:
    """The backend JAX will start, guessed *without* starting it: ``JAX_PLATFORMS`` if set, else the
    installed plugin (``libtpu`` → tpu, ``jax_cuda*_plugin`` → gpu), else cpu."""
    import importlib.util
    import os

    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(first, "cpu")
    if importlib.util.find_spec("libtpu"):
        return "tpu"
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "gpu"
    return "cpu"


def apply_scheduling_flags(backend: Optional[str] = None, environ=None) -> Dict[str, str]:
    """Append meshtrain's scheduling flags for ``backend`` (default: :func:`detect_backend`) to the
    environment, before JAX starts its backend; a flag the user already set keeps the user's value.
    Returns ``{variable: flags added}``. ``meshtrain train`` calls it (``--xla-flags none`` skips it)::

        apply_scheduling_flags("gpu")     # then import/use jax
    """
    import os

    environ = os.environ if environ is None else environ
    backend = backend or detect_backend(environ)
    added: Dict[str, str] = {}
    var, flags = SCHEDULING_FLAGS[backend]
    current = environ.get(var, "")
    new = [f"--{f}={v}" for f, v, _ in flags if f"--{f}=" not in current and f"--{f} " not in current + " "]
    if new:
        environ[var] = (current + " " + " ".join(new)).strip()
        added[var] = " ".join(new)
    return added
