"""Decode-time matmuls that read bf16 weights as stored, on CPU: the weight is kept ``(out, in)`` (each output's
weights one contiguous row) and a small C++ kernel (``bf16_rows.cc``, called through XLA's FFI) multiplies a few
activation rows by it, accumulating in f32.

Why: XLA:CPU has no bf16 matmul. For ``x @ w`` with a bf16 ``w`` its compiled HLO is ``convert`` to an
``f32[in, out]`` copy, then an f32 ``dot`` (the dump: ``wrapped_convert = f32[640,1728] fusion(w)``, then
``dot(x, wrapped_convert)``), so a decode step reads 2 + writes 4 + reads 4 bytes per weight, or (converted once
per generation) 4: f32's memory-bandwidth floor whatever the stored format. A fused multiply + reduce in its
place is 20-40x slower (XLA:CPU's reduction loops), and a kernel over the ``(in, out)`` layout reads the weight in
strided pieces (no faster than f32's dot). Over ``(out, in)`` rows a decode step reads 2 bytes per weight
(BENCHMARKS.md, "The decode-speed bar, bf16 weights read as stored").

Where it runs: :func:`meshtrain.parallel.resolved.ResolvedStep.for_generation` decides (``DecodeMatmul``); the
engine then stores the layers' matmul weights (and an untied head) as :class:`RowsWeight` and the model's
projections call :func:`project`. A matmul of more than :data:`MAX_ROWS` rows (a long prefill) multiplies the same
stored weight with XLA's dot instead (converted to f32 once in that step). The kernel is built on first use with
the host's C++ compiler (``$CXX`` or ``c++``) into ``$MESHTRAIN_KERNEL_CACHE`` (default
``~/.cache/meshtrain/kernels``); without a compiler :func:`kernel_ready` is ``False`` and decoding stays on XLA.

Example::

    w = pack(w_df.astype(jnp.bfloat16), n_in=1, dtype=jnp.bfloat16)    # (d, f) -> stored (f, d)
    y_btf = project(x_btd, w)                                           # = x_btd @ w_df, in bf16
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import platform
import subprocess
import tempfile
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from meshtrain.errors import ConfigError

#: matmuls of at most this many activation rows (batch x new tokens) use the kernel; more use XLA's dot. Why 8: the
#: kernel does 2 x rows flops per weight it reads; past ~8 rows AVX-512 FMAs, not the bytes, bound it (XLA's f32
#: matmul blocks for many rows; a long prefill or a server's full batch is better there)
MAX_ROWS = 8
#: the smallest layer projection (weights) worth the kernel: its FFI call costs ~1-2 us, more than the bytes it
#: saves below this (``tiny``, 64 x 256: 2x slower with the kernel; llama-114m, 640 x 1728: faster)
MIN_ELEMENTS = 2 ** 17
#: the FFI targets' names: f32 activations, and bf16 ones (a bf16 model's: AVX512-BF16 dot products where the CPU
#: has them; the products of two bf16 are exact in f32 either way)
TARGET = "meshtrain_bf16_rows"
TARGET_BF16 = "meshtrain_bf16_rows_bf16"
_SOURCE = os.path.join(os.path.dirname(__file__), "bf16_rows.cc")
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++20", "-shared", "-fPIC", "-w")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowsWeight:
    """A matmul weight of logical ``shape`` (its first ``n_in`` dims contracted with the activation's last ones)
    stored as ``wt`` ``(prod(out dims), prod(in dims))`` bf16; ``dtype`` is the dtype the model would have
    multiplied by (the result's dtype follows it as ``x @ w`` would). Stands in for the weight array inside the
    model (``variable[...]`` returns it; ``.shape`` is the logical shape)."""

    wt: jax.Array
    shape: Tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    n_in: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True), default="bfloat16")

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"a RowsWeight is read whole (w[...]), not w[{index!r}]")
        return self

    @property
    def ndim(self) -> int:
        return len(self.shape)


def pack(w, n_in: int, dtype="bfloat16", storage="bfloat16") -> RowsWeight:
    """``w`` (logical shape ``in dims + out dims``, the first ``n_in`` dims contracted) stored ``(out, in)`` in
    ``storage`` (bf16 for this kernel; f32 for :mod:`meshtrain.kernels.decode_step`'s row layout, which XLA's dot
    multiplies everywhere else)."""
    k = math.prod(w.shape[:n_in])
    return RowsWeight(jnp.asarray(w).reshape(k, -1).T.astype(storage), tuple(w.shape), n_in, jnp.dtype(dtype).name)


def project(x, w: RowsWeight):
    """``x @ w`` over ``w``'s ``n_in`` contracted dims: ``x`` ``(..., *in)`` -> ``(..., *out)``, in
    ``result_type(x, w.dtype)``; f32 accumulation either way (the kernel for at most :data:`MAX_ROWS` rows)."""
    ins, outs = w.shape[:w.n_in], w.shape[w.n_in:]
    if tuple(x.shape[x.ndim - w.n_in:]) != tuple(ins):
        raise ConfigError(f"project: x {x.shape} does not end in the weight's input dims {ins}")  # a bug, not input
    lead = x.shape[:x.ndim - w.n_in]
    x_mk = x.reshape(-1, math.prod(ins))
    if x_mk.shape[0] <= MAX_ROWS and w.wt.dtype == jnp.bfloat16:
        target, x_mk = (TARGET_BF16, x_mk) if x_mk.dtype == jnp.bfloat16 else (TARGET, x_mk.astype(jnp.float32))
        y_mn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x_mk.shape[0], w.wt.shape[0]), jnp.float32))(x_mk, w.wt)
    else:  # bf16 -> f32 is exact; an f32 weight stored (out, in) is XLA's dot with the other contracting dim
        y_mn = jnp.einsum("mk,nk->mn", x_mk.astype(jnp.float32), w.wt.astype(jnp.float32))
    return y_mn.reshape(*lead, *outs).astype(jnp.result_type(x.dtype, jnp.dtype(w.dtype)))


def _cache_dir() -> str:
    return os.environ.get("MESHTRAIN_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "meshtrain",
                                                                    "kernels")


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (a cached build is per CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f.read().splitlines() if l.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def build_library(path: str, name: str) -> str:
    """The shared library of the C++ kernel at ``path``, compiled once per source, compiler flags, jaxlib and CPU
    into ``<cache>/<name>-<hash>.so`` (atomic rename: test workers may build at once); raises ``OSError`` /
    ``subprocess.SubprocessError`` when it cannot. Example: ``build_library("decode_step.cc", "decode_step")``."""
    with open(path, "rb") as f:
        source = f.read()
    cxx = os.environ.get("CXX", "c++")
    tag = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"{name}-{tag}.so")
    if os.path.exists(out):
        return out
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    try:
        subprocess.run([cxx, *_FLAGS, "-I", jax.ffi.include_dir(), path, "-o", tmp], check=True,
                       capture_output=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def load_and_register(path: str, name: str, targets: Dict[str, str]) -> Tuple[bool, str]:
    """Build the C++ kernel at ``path`` (:func:`build_library`), load it and register each XLA:CPU FFI target
    of ``targets`` (target name -> the library's handler symbol). Returns ``(True, "built")``, or ``(False, why)``
    where it cannot (an untested CPU architecture, no compiler, a failed build): the caller then keeps XLA's path.
    Example: ``load_and_register(_SOURCE, "bf16_rows", {TARGET: "MeshtrainBf16Rows"})``."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False, f"untested CPU architecture {platform.machine()!r}"
    try:
        library = ctypes.cdll.LoadLibrary(build_library(path, name))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return False, f"{type(e).__name__}: {e} {detail.decode(errors='replace')[-300:]}".strip()
    return True, "built"


@functools.lru_cache(maxsize=1)
def _ready() -> Tuple[bool, str]:
    ready = load_and_register(_SOURCE, "bf16_rows", {TARGET: "MeshtrainBf16Rows", TARGET_BF16: "MeshtrainBf16RowsBf16"})
    if not ready[0]:
        return ready
    # the built kernel must agree with XLA before any step relies on it
    x = np.linspace(-1, 1, 3 * 37, dtype=np.float32).reshape(3, 37)
    w = jnp.asarray(np.cos(np.arange(37 * 21, dtype=np.float32)).reshape(37, 21)).astype(jnp.bfloat16)
    for x_in in (jnp.asarray(x), jnp.asarray(x).astype(jnp.bfloat16)):
        got = np.asarray(jax.jit(project)(x_in, pack(w, 1, "float32")))
        want = np.asarray(x_in.astype(jnp.float32)) @ np.asarray(w.astype(jnp.float32))
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            return False, f"the built kernel disagrees with XLA's dot by {np.max(np.abs(got - want)):.3g}"
    return True, "built"


def kernel_ready() -> bool:
    """Whether the kernel is built, registered with XLA:CPU and checked against XLA's dot (builds it on first call)."""
    return _ready()[0]


def why_not_ready() -> str:
    """The reason :func:`kernel_ready` is ``False`` (the compiler's error, for a log line)."""
    return _ready()[1]
