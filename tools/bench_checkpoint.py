"""Checkpoint benchmark: training stall per async save vs a synchronous save, and save throughput vs the
raw write speed of the same disk, all in one run and one folder.

    python tools/bench_checkpoint.py                       # ~200 MB TrainState, 8 simulated CPU devices
    python tools/bench_checkpoint.py --dir /mnt/fast --mb 400 --json

What is measured (same state, same folder, same process):

* raw write: the state's byte count written with ``os.write`` in 8 MiB chunks, then ``fsync``
  (``raw_fsync``), and the same without ``fsync`` (``raw_buffered``, page-cache speed).
* sync save: ``Checkpointer(async_save=False).maybe_save`` wall time until the step is committed
  with its manifest (write + SHA-256 of every file + rename); throughput = state bytes / time.
* async save inside a training loop: ``SaveResult.blocking_s`` of each save (the stall: the loop
  cannot run while Orbax takes the arrays' host copies and starts its writer; the loop waits for
  every device to finish the step first, so step compute is not counted as stall; on CPU it includes
  copying the saved shards, so that the next step can donate them), the same counting
  every ``maybe_save`` call (calls between saves collect the finished save and apply retention), and
  the loop's extra wall time per save compared with the same steps without saving (the writer
  thread competes with the step for CPU cores; noisy on a shared machine).
* sync save inside the same training loop: its ``blocking_s`` (the whole save).
* donation: how many of the state's buffers the step right after each async save donated (all of
  them, unless something still references the saved device buffers: XLA then silently copies).
* async saves with the host CPU idle first (a 50 ms pause, not counted): XLA:CPU's worker threads
  spin for a while after each step and slow the save call on a 2-core machine; on GPU/TPU hosts
  the step does not occupy the host CPU, so this figure is the one that transfers.

stall ratio = median async ``blocking_s`` / median sync ``blocking_s``, both in the loop (target ≤ 5 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_DEVICES", "8")))

import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.checkpoint import Checkpointer, Compression  # noqa: E402

CHUNK = 8 << 20
IDLE_PAUSE_S = 0.05


def build(mb: float, recipe_name: str):
    """A decoder whose TrainState (params + Adam mu, nu) is about ``mb`` MB, on all devices."""
    for d_model in (512, 256, 128):                           # the widest that still gives 2+ layers
        d_ff = 4 * d_model
        per_layer = 4 * d_model * d_model + 3 * d_model * d_ff
        layers = max(1, round(mb * 1e6 / 12 / per_layer))    # 3 f32 copies of every parameter
        if layers >= 2:
            break
    cfg = mt.models.get_config("small", d_model=d_model, n_layers=layers, n_heads=8, n_kv_heads=8,
                               head_dim=d_model // 8, d_ff=d_ff, max_seq_len=64)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-4))
    recipe = mt.get_recipe(recipe_name)
    mesh = recipe.mesh.build(jax.devices())
    probe = mt.make_plan(abstract, recipe, mesh, check=False)
    plan = mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(probe.data_parallel_size, 64))
    return cfg, plan


def batch_for(plan, step):
    import numpy as np

    b, t = plan.batch.batch_size, plan.batch.seq_len
    rng = np.random.default_rng(step)
    toks = rng.integers(0, 256, (b, t + 1))
    host = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": np.broadcast_to(np.arange(t), (b, t)),
            "segment_ids": np.zeros((b, t))}
    return {k: jax.device_put(np.asarray(v, np.int32), plan.batch_shardings[k]) for k, v in host.items()}


def raw_write(folder: Path, nbytes: int, fsync: bool) -> float:
    """Seconds to write ``nbytes`` of incompressible data into ``folder`` (optionally fsync'ed)."""
    block = os.urandom(CHUNK)
    path = folder / f"raw-{'fsync' if fsync else 'buffered'}.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:min(CHUNK, left)])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temporary folder)")
    ap.add_argument("--mb", type=float, default=200.0, help="approximate TrainState size in MB")
    ap.add_argument("--recipe", default="fsdp", help="recipe whose shardings the state is saved from")
    ap.add_argument("--repeats", type=int, default=3, help="sync saves and raw writes to take the median of")
    ap.add_argument("--saves", type=int, default=3, help="saves in each training loop (async, then sync)")
    ap.add_argument("--every", type=int, default=4, help="training steps between saves")
    ap.add_argument("--compression", choices=[c.value for c in Compression], default="zstd",
                    help="chunk compression of the checkpoints (zstd: Orbax's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--max-stall-ratio", type=float, default=None,
                    help="exit 1 when the async stall exceeds this fraction of the sync save (e.g. 0.05)")
    args = ap.parse_args(argv)

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        cfg, plan = build(args.mb, args.recipe)
        state = mt.init_state(plan, seed=0)
        step_fn = mt.make_train_step(plan)
        state, _ = step_fn(state, batch_for(plan, 0))           # compile
        jax.block_until_ready(state)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        meta = {"recipe": plan.recipe.to_dict(), "model": cfg.name, "seed": 0}

        raw_fsync = statistics.median(raw_write(root, nbytes, True) for _ in range(args.repeats))
        raw_buffered = statistics.median(raw_write(root, nbytes, False) for _ in range(args.repeats))

        sync_times = []
        with Checkpointer(root / "sync", save_every=1, keep_last=1, async_save=False,
                          compression=args.compression) as ckpt:
            for i in range(1, args.repeats + 1):
                t0 = time.perf_counter()
                ckpt.maybe_save(i, state, data_state={}, metadata=meta)
                sync_times.append(time.perf_counter() - t0)
        disk_bytes = sum(p.stat().st_size for p in (root / "sync").rglob("*") if p.is_file())

        # the same training loop three times: without saves, with async saves, with sync saves
        steps = args.saves * args.every

        def loop(mode):
            blocked, other, donated = [], 0.0, []
            ckpt = None if mode == "plain" else Checkpointer(
                root / f"{mode}-loop", save_every=args.every, keep_last=1, async_save=mode == "async",
                compression=args.compression)
            st = state_box[0]
            t0 = time.perf_counter()
            just_saved = False
            for i in range(1, steps + 1):
                old = jax.tree.leaves(st)
                st, m = step_fn(st, batch_for(plan, i))
                if just_saved:   # the step right after a save: were all its input buffers donated?
                    donated.append(sum(x.is_deleted() for x in old))
                del old
                float(m["loss"])                                 # a real loop reads its metrics
                jax.block_until_ready(st)                        # blocking_s counts checkpoint work only
                just_saved = False
                if ckpt is not None:
                    res = ckpt.maybe_save(i, st, data_state={"step": i}, metadata=meta)
                    just_saved = res.saved
                    if res.saved:
                        blocked.append(res.blocking_s)
                    else:   # calls between saves collect the finished save and apply retention
                        other += res.blocking_s
            t_wait = time.perf_counter()
            if ckpt is not None:
                ckpt.close()                                     # waits for the last async save
            final_wait = time.perf_counter() - t_wait
            state_box[0] = st
            return blocked, other, t_wait - t0, final_wait, donated

        state_box = [state]
        _, _, loop_plain, _, _ = loop("plain")
        stalls, other_calls, loop_async, final_wait, donated_after_async = loop("async")
        sync_stalls, _, loop_sync, _, _ = loop("sync")
        # async saves once the host CPU is idle (XLA:CPU's worker threads keep spinning for a few ms
        # after a step; on GPU/TPU the step does not run on the host, so this is the stall there)
        idle_stalls = []
        with Checkpointer(root / "idle", save_every=1, keep_last=1, compression=args.compression) as ckpt:
            for i in range(1, args.saves + 1):
                ckpt.wait()
                time.sleep(IDLE_PAUSE_S)
                idle_stalls.append(ckpt.maybe_save(i, state_box[0], data_state={}, metadata=meta).blocking_s)
        sync_s = statistics.median(sync_times)
        stall_s = statistics.median(stalls)
        sync_stall_s = statistics.median(sync_stalls)
        total_stall_per_save = (sum(stalls) + other_calls) / len(stalls)
        out = {
            "device": f"{len(jax.devices())} x {jax.devices()[0].platform}", "cpu_cores": os.cpu_count(),
            "recipe": plan.recipe.name, "compression": args.compression, "layers": cfg.n_layers,
            "params": plan.abstract.num_params, "state_bytes": nbytes, "checkpoint_bytes_on_disk": disk_bytes,
            "raw_fsync_s": raw_fsync, "raw_fsync_MBps": nbytes / raw_fsync / 1e6,
            "raw_buffered_s": raw_buffered, "raw_buffered_MBps": nbytes / raw_buffered / 1e6,
            "sync_save_s": sync_s, "sync_save_all_s": sync_times, "sync_save_MBps": nbytes / sync_s / 1e6,
            "sync_vs_raw_fsync": raw_fsync / sync_s, "sync_vs_raw_buffered": raw_buffered / sync_s,
            "async_stall_s": stall_s, "async_stall_all_s": stalls,
            "sync_stall_in_loop_s": sync_stall_s, "sync_stall_in_loop_all_s": sync_stalls,
            "stall_ratio": stall_s / sync_stall_s,
            "async_stall_idle_cpu_s": statistics.median(idle_stalls), "async_stall_idle_cpu_all_s": idle_stalls,
            "stall_ratio_idle_cpu": statistics.median(idle_stalls) / sync_stall_s,
            "async_stall_incl_other_calls_s": total_stall_per_save,
            "stall_incl_other_calls_ratio": total_stall_per_save / sync_stall_s, "final_wait_s": final_wait,
            "step_s": loop_plain / steps, "state_buffers": len(jax.tree.leaves(state_box[0])),
            "donated_after_async_save": donated_after_async,
            "loop_overhead_per_async_save_s": (loop_async - loop_plain) / args.saves,
            "loop_overhead_per_sync_save_s": (loop_sync - loop_plain) / args.saves,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
        print(f"state {mb(out['state_bytes'])} ({out['params']:,} params, {out['layers']} layers, recipe "
              f"{out['recipe']}, {out['device']}, {out['cpu_cores']} cores); "
              f"on disk {mb(out['checkpoint_bytes_on_disk'])} ({out['compression']})")
        print(f"raw write      {out['raw_fsync_s']:.3f} s  {out['raw_fsync_MBps']:.0f} MB/s (fsync)   "
              f"{out['raw_buffered_s']:.3f} s  {out['raw_buffered_MBps']:.0f} MB/s (buffered)")
        print(f"sync save      {out['sync_save_s']:.3f} s  {out['sync_save_MBps']:.0f} MB/s  "
              f"= {out['sync_vs_raw_fsync']:.0%} of raw fsync speed, {out['sync_vs_raw_buffered']:.0%} of buffered")
        print(f"stall per save in the training loop: async {out['async_stall_s'] * 1e3:.1f} ms, sync "
              f"{out['sync_stall_in_loop_s'] * 1e3:.0f} ms -> {out['stall_ratio']:.1%} (target <= 5%)")
        print(f"               async, all: {', '.join(f'{s * 1e3:.1f}' for s in stalls)} ms; counting every "
              f"maybe_save call {out['async_stall_incl_other_calls_s'] * 1e3:.1f} ms per save "
              f"= {out['stall_incl_other_calls_ratio']:.1%}")
        print(f"               with the host CPU idle before the save (as on GPU/TPU hosts): "
              f"{out['async_stall_idle_cpu_s'] * 1e3:.1f} ms -> {out['stall_ratio_idle_cpu']:.1%}")
        print(f"donation       the step right after each async save donated "
              f"{', '.join(map(str, out['donated_after_async_save'])) or '-'} of {out['state_buffers']} state "
              f"buffers (fewer: XLA silently keeps a second copy of the state for that step)")
        print(f"training loop  {out['step_s']:.3f} s/step; extra loop time per save: async "
              f"{out['loop_overhead_per_async_save_s']:.3f} s, sync {out['loop_overhead_per_sync_save_s']:.3f} s "
              f"(noisy on a shared machine; async: the writer competes with the step for CPU)")
    if args.max_stall_ratio is not None and out["stall_ratio"] > args.max_stall_ratio:
        print(f"FAIL: async stall is {out['stall_ratio']:.1%} of the sync save, above {args.max_stall_ratio:.1%}")
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    main()
