"""cuDNN's fused attention on packed documents against meshtrain's blockwise XLA kernel, on a GPU.

Random bf16 ``q``/``k``/``v`` (grouped-query heads) over rows of packed documents: one document, a
few, exactly ``flash.CUDNN_MAX_SEGMENTS`` (the ragged layout's room) and one-token documents at
both ends. ``flash_attention(..., backend="cudnn")`` and ``backend="xla"`` give the output and the
``q``/``k``/``v`` gradients of a random cotangent; the script prints each one's largest difference
relative to the XLA value's largest magnitude and exits 1 above :data:`TOLERANCE`. It also prints

* the same figures for cuDNN *without* segment ids (its trusted unpacked path: the numerical
  difference to expect) and for a wrong mask (plain causal cuDNN against packed XLA: what a masking
  bug looks like), so the margin is visible;
* a batch the layout cannot take (a row with one document too many, an id that recurs): it must run
  the blockwise fallback, whose result equals the XLA kernel's;
* the cuDNN custom calls in the compiled forward + backward (exit 1 if either count is 0) and the
  median time of each variant (cuDNN packed with the default room and with room 8: what the room
  costs; unpacked cuDNN; the XLA kernel).

Exits 2 (one line) where JAX sees no GPU; ``--dry-run`` then checks only the ragged description of
the same rows (the mask it implies equals segment-equality ∧ causal) on this host.

    python tools/check_cudnn_packed.py                 # on a Hopper GPU, ~30 s
    python tools/check_cudnn_packed.py --dry-run       # anywhere
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Largest allowed difference, relative to the XLA value's largest magnitude. Both kernels read the
#: same bf16 inputs; cuDNN rounds the probabilities (forward) and the score gradients (backward) to
#: bf16 before their matmuls, the XLA kernel keeps f32, and both round the results to bf16: a few
#: units of bf16's 2⁻⁸ relative step. 2⁻⁵ leaves room for that; a token that sees across a document
#: boundary, or misses part of its own document, moves its output by the size of the values
#: themselves (the "wrong mask" line shows how far).
TOLERANCE = 2 ** -5


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each variant")
    p.add_argument("--dry-run", action="store_true", help="without a GPU: check only the ragged description")
    return p.parse_args(argv)


def packed_rows(t: int, room: int, seed: int = 0):
    """(4, t) segment ids: 1 document, 5, ``room`` (the most that fits), and one-token documents at
    both ends; ids count up per row from 0, as ``meshtrain.data.packing`` writes them."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def row(cuts):
        ids = np.zeros(t, np.int32)
        for c in sorted(cuts):
            ids[c:] += 1
        return ids

    return np.stack([row([]), row(rng.choice(np.arange(1, t), 4, replace=False)),
                     row(rng.choice(np.arange(1, t), room - 1, replace=False)), row([1, 2, t - 1])])


def unfit_rows(t: int, room: int):
    """Rows the ragged layout cannot take: ``room + 1`` documents, and an id that recurs."""
    import numpy as np

    rows = packed_rows(t, room + 1, seed=1)
    rows[1] = np.where(np.arange(t) >= t - t // 4, 0, rows[1])  # document 0 again at the end
    return rows


def mask_from(lengths, offsets, t: int):
    """The (b, t, t) causal mask that cuDNN's ragged description means."""
    import numpy as np

    b = lengths.shape[0]
    doc = np.full((b, t), -1)
    for r in range(b):
        for m, (off, n) in enumerate(zip(offsets[r], lengths[r])):
            if n > 0:
                doc[r, off:off + n] = m
    causal = np.tril(np.ones((t, t), bool))
    return (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & causal


def dry_run(args) -> int:
    import numpy as np

    from meshtrain.parallel import flash

    room = flash.CUDNN_MAX_SEGMENTS
    seg = packed_rows(args.seq_len, room)
    lengths, offsets, fits = (np.asarray(x) for x in flash.cudnn_segments(seg, room))
    want = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((args.seq_len,) * 2, bool))
    same = bool((mask_from(lengths, offsets, args.seq_len) == want).all())
    unfit = bool(flash.cudnn_segments(unfit_rows(args.seq_len, room), room)[2])
    print(f"dry run: {seg.shape[0]} rows of {args.seq_len} tokens, {[len(set(r)) for r in seg]} documents, room "
          f"{room}: fits {bool(fits)}, ragged mask == segment mask: {same}; unfit rows fit: {unfit}")
    return 0 if fits and same and not unfit else 1


def main(argv=None) -> int:
    args = _parse(argv)
    import jax

    if jax.default_backend() != "gpu":
        if args.dry_run:
            return dry_run(args)
        print(f"check_cudnn_packed: needs an NVIDIA GPU (JAX's backend here is {jax.default_backend()!r}); "
              f"--dry-run checks the ragged description only", file=sys.stderr)
        return 2
    import jax.numpy as jnp
    import numpy as np

    from meshtrain.analysis.gpu_aot import cudnn_attention_calls
    from meshtrain.parallel import flash

    room, t = flash.CUDNN_MAX_SEGMENTS, args.seq_len
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; q (4, {t}, {args.heads}, {args.head_dim}) bf16, "
          f"{args.kv_heads} K/V heads, room {room} documents per row; tolerance {TOLERANCE:.4f} of max |xla|")
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (4, t, args.heads, args.head_dim)
    q, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (4, t, args.kv_heads, args.head_dim), jnp.bfloat16) for kk in keys[2:])

    def run(backend, with_segments=True, room=None):
        def f(q, k, v, seg):
            o, vjp = jax.vjp(lambda q, k, v: flash.flash_attention(q, k, v, seg if with_segments else None,
                                                                   backend=backend, max_segments=room), q, k, v)
            return (o, *vjp(do))
        return jax.jit(f)

    def errors(got, want):
        return [float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()
                      / jnp.abs(w.astype(jnp.float32)).max()) for g, w in zip(got, want)]

    def line(name, errs):
        return f"  {name:34s}" + "".join(f"{e:>10.5f}" for e in errs)

    seg = jnp.asarray(packed_rows(t, room))
    unfit = jnp.asarray(unfit_rows(t, room))
    fused, xla, plain = run("cudnn"), run("xla"), run("cudnn", with_segments=False)
    ref = xla(q, k, v, seg)
    packed = errors(fused(q, k, v, seg), ref)
    baseline = errors(plain(q, k, v, seg), run("xla", with_segments=False)(q, k, v, seg))
    wrong = errors(plain(q, k, v, seg), ref)
    fallback = errors(fused(q, k, v, unfit), xla(q, k, v, unfit))
    fits = [bool(flash.cudnn_segments(s, room)[2]) for s in (seg, unfit)]
    print(f"max |cudnn - xla| / max |xla|        {'out':>10s}{'dq':>10s}{'dk':>10s}{'dv':>10s}")
    print(line(f"packed ({[len(set(r)) for r in np.asarray(seg)]} docs)", packed))
    print(line("unpacked cuDNN vs xla (expected)", baseline))
    print(line("wrong mask (causal only)", wrong))
    print(line("unfit rows (fallback: xla)", fallback))
    calls = cudnn_attention_calls(fused.lower(q, k, v, seg).compile().as_text())
    print(f"cuDNN custom calls in the packed forward + backward: {calls}; rows fit the layout: {fits[0]}, "
          f"unfit rows: {fits[1]}")
    times, few = {}, jnp.asarray(packed_rows(t, 8))  # rows of 1 to 8 documents: cuDNN's path at either room
    variants = ((f"cudnn packed (room {room})", fused), ("cudnn packed (room 8)", run("cudnn", room=8)),
                ("cudnn unpacked", plain), ("xla packed", xla))
    for name, fn in variants:
        jax.block_until_ready(fn(q, k, v, few))
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, few))
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
    print("forward + backward, median: " + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in times.items()))
    ok = (max(packed) <= TOLERANCE and max(fallback) <= TOLERANCE and calls["forward"] > 0 and calls["backward"] > 0
          and fits == [True, False])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
