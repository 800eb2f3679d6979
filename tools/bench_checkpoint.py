"""Checkpoint benchmark: save throughput vs the raw write speed of the same disk, host memory during a
save, and the training stall of an async save vs a synchronous one, all in one run and one folder.

    python tools/bench_checkpoint.py                       # ~200 MB TrainState, 8 simulated CPU devices
    python tools/bench_checkpoint.py --compare             # the same, earlier settings vs current, alternating
    python tools/bench_checkpoint.py --compare --before main --busy 1   # vs background_start off, busy host
    python tools/bench_checkpoint.py --compare --before sha256          # XXH3-128 manifest vs SHA-256
    python tools/bench_checkpoint.py --dir /mnt/fast --mb 400 --json

What is measured (same state, same folder, same process):

* raw write: the state's byte count written with ``os.write`` in 8 MiB chunks, then ``fsync``
  (``raw_fsync``), and the same without ``fsync`` (``raw_buffered``, page-cache speed).
* sync save: ``Checkpointer(async_save=False).maybe_save`` wall time until the step is committed
  with its manifest (write + block checksums of every file + rename); throughput = state bytes / time.
* host memory: the process's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``
  right before the save, after ``malloc_trim``; a 1 ms ``VmRSS`` sampler where the reset is not
  allowed) minus its resident memory just before the save, for a sync save and for an async save
  (from the call until the write is committed), as a multiple of the state's bytes. On CPU the
  "device" arrays live in host memory too: the figure is what the save adds on top of them.
* async save inside a training loop: ``SaveResult.blocking_s`` of each save (the stall: the loop
  cannot run while Orbax takes the arrays' host copies and starts its writer; the loop waits for
  every device to finish the step first, so step compute is not counted as stall; on CPU it includes
  copying the saved shards, so that the next step can donate them; with ``background_start`` only
  the checks and enqueueing that copy: Orbax starts in a worker thread), the same counting
  every ``maybe_save`` call (calls between saves collect the finished save and apply retention), and
  the loop's extra wall time per save compared with the same steps without saving (the writer
  thread competes with the step for CPU cores; noisy on a shared machine).
* sync save inside the same training loop: its ``blocking_s`` (the whole save).
* donation: how many of the state's buffers the step right after each async save donated (all of
  them, unless something still references the saved device buffers: XLA then silently copies).
* async saves with the host CPU idle first (a 50 ms pause, not counted): XLA:CPU's worker threads
  spin for a while after each step and slow the save call on a 2-core machine; on GPU/TPU hosts
  the step does not occupy the host CPU, so this figure is the one that transfers.

stall ratio = median async ``blocking_s`` / median sync ``blocking_s``, both in the loop (target <= 5 %).

``--compare`` runs every measurement for two settings of the same code, alternating between them
(raw write, sync save "before", sync save "after", raw write, ...; loops: before, after):

* ``before``: ``--before issue14`` (default): the settings up to issue 14 (zstd chunks, the
  manifest hashed with 8 MiB ``read`` calls, a copy before sync saves too); ``--before main``: the
  Checkpointer's defaults, Orbax's blocking part on the calling thread (``background_start=False``);
  ``--before sha256``: today's save path with the SHA-256 manifest saves wrote before XXH3-128;
* ``after``: what the Trainer uses: ``--compression`` (default ``none``), the manifest hashed from
  the page cache, no copy before a synchronous save, and ``background_start=True`` (Orbax's
  blocking part in a worker thread; the loop only enqueues the copy of the saved buffers).

``--busy N`` runs N ``yes > /dev/null`` processes for the whole run (a busy host; the issue's
figures used one beside the benchmark on 2 cores).

The JSON's top-level figures are those of ``after``; ``configs`` holds both.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_DEVICES", "8")))

import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.checkpoint import Checkpointer, Compression  # noqa: E402
from meshtrain.checkpoint.saving import SaveTuning, tuned  # noqa: E402
from meshtrain.checkpoint.types import Checksum  # noqa: E402

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


@dataclasses.dataclass(frozen=True)
class Setting:
    """How the Checkpointer saves (the same code; ``before`` restores the earlier behaviour)."""

    compression: str
    mapped_hashing: bool       # manifest hashed from the page cache (mmap) instead of 8 MiB reads
    copy_before_sync_save: bool
    background_start: bool = False   # Orbax's blocking part in a worker thread (async saves)
    checksum: Checksum = Checksum.XXH3_128   # the manifest's block checksum

    def checkpointer(self, folder: Path, **kw) -> Checkpointer:
        with tuned(SaveTuning(mapped_hashing=self.mapped_hashing, copy_before_sync_save=self.copy_before_sync_save,
                              checksum=self.checksum)):
            return Checkpointer(folder, compression=self.compression, background_start=self.background_start, **kw)


BEFORE = {"issue14": Setting("zstd", mapped_hashing=False, copy_before_sync_save=True, checksum=Checksum.SHA256),
          "main": Setting("none", mapped_hashing=True, copy_before_sync_save=False, background_start=False,
                          checksum=Checksum.SHA256),
          # issue 37: the current save path with the SHA-256 manifest it wrote before XXH3-128
          "sha256": Setting("none", mapped_hashing=True, copy_before_sync_save=False, background_start=True,
                            checksum=Checksum.SHA256)}


# -- host memory ------------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """Peak resident memory of this process inside a ``with`` block, above its level at the start.

    Freed heap memory is first returned to the OS (``malloc_trim``), so that the figure does not
    depend on what earlier saves left in the allocator; the kernel's peak (``VmHWM``) is reset through
    ``/proc/self/clear_refs`` and read at the end (exact, no sampling). Where the reset is not
    allowed a thread samples ``VmRSS`` every millisecond instead (``method`` says which)."""

    def __enter__(self) -> "PeakRSS":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.base = _status_kib("VmRSS") << 10
        self.peak, self._stop = self.base, threading.Event()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method, self._thread = "VmHWM", None
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status_kib("VmRSS") << 10)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_kib("VmRSS") << 10)
        else:
            self.peak = max(self.peak, _status_kib("VmHWM") << 10)

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


# -- the measurements -------------------------------------------------------------------------------

def sync_save(ckpt: Checkpointer, step: int, state, meta) -> dict:
    """One synchronous save: seconds until committed, and the host memory it added."""
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        ckpt.maybe_save(step, state, data_state={}, metadata=meta)
        dt = time.perf_counter() - t0
    return {"s": dt, "rss_extra": mem.extra, "rss_method": mem.method}


def run_loop(setting: Optional[Setting], folder: Path, mode: str, state, step_fn, plan, args, meta):
    """``args.saves * args.every`` training steps; ``mode``: plain (no saves), async or sync."""
    steps = args.saves * args.every
    blocked, other, donated = [], 0.0, []
    ckpt = None if mode == "plain" else setting.checkpointer(
        folder, save_every=args.every, keep_last=1, async_save=mode == "async")
    st = state
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
    return st, {"blocked": blocked, "other": other, "loop_s": t_wait - t0, "final_wait": final_wait,
                "donated": donated}


def idle_async_saves(setting: Setting, folder: Path, state, n: int, meta):
    """Async saves after a pause (host CPU idle); memory from the call until the step is committed."""
    stalls, extra = [], []
    with setting.checkpointer(folder, save_every=1, keep_last=1) as ckpt:
        for i in range(1, n + 1):
            ckpt.wait()
            time.sleep(IDLE_PAUSE_S)
            with PeakRSS() as mem:
                stalls.append(ckpt.maybe_save(i, state, data_state={}, metadata=meta).blocking_s)
                ckpt.wait()
            extra.append(mem.extra)
    return stalls, extra


def summarize(name: str, setting: Setting, r: dict, nbytes: int, raw_fsync: float, raw_buffered: float,
              loop_plain: float, saves: int) -> dict:
    sync_s = statistics.median(x["s"] for x in r["sync"])
    stall_s = statistics.median(r["async_loop"]["blocked"])
    sync_stall_s = statistics.median(r["sync_loop"]["blocked"])
    idle = statistics.median(r["idle_stalls"])
    loop = r["async_loop"]
    total_stall_per_save = (sum(loop["blocked"]) + loop["other"]) / len(loop["blocked"])
    sync_rss = max(x["rss_extra"] for x in r["sync"])
    async_rss = max(r["async_rss"])
    return {
        "setting": name, "compression": setting.compression, "mapped_hashing": setting.mapped_hashing,
        "copy_before_sync_save": setting.copy_before_sync_save, "background_start": setting.background_start,
        "checkpoint_bytes_on_disk": r["disk_bytes"],
        "sync_save_s": sync_s, "sync_save_all_s": [x["s"] for x in r["sync"]], "sync_save_MBps": nbytes / sync_s / 1e6,
        "sync_vs_raw_fsync": raw_fsync / sync_s, "sync_vs_raw_buffered": raw_buffered / sync_s,
        "sync_save_peak_rss_extra_bytes": sync_rss, "sync_save_peak_rss_x_state": sync_rss / nbytes,
        "async_save_peak_rss_extra_bytes": async_rss, "async_save_peak_rss_x_state": async_rss / nbytes,
        "rss_method": r["sync"][0]["rss_method"],
        "async_stall_s": stall_s, "async_stall_all_s": r["async_loop"]["blocked"],
        # the first save of a process also pays the page faults of the copy's fresh memory; later saves
        # reuse the memory the previous save's copy freed
        "async_stall_first_s": r["async_loop"]["blocked"][0],
        "async_stall_later_median_s": statistics.median(r["async_loop"]["blocked"][1:] or r["async_loop"]["blocked"]),
        "sync_stall_in_loop_s": sync_stall_s, "sync_stall_in_loop_all_s": r["sync_loop"]["blocked"],
        "stall_ratio": stall_s / sync_stall_s,
        "async_stall_idle_cpu_s": idle, "async_stall_idle_cpu_all_s": r["idle_stalls"],
        "stall_ratio_idle_cpu": idle / sync_stall_s,
        "async_stall_incl_other_calls_s": total_stall_per_save,
        "stall_incl_other_calls_ratio": total_stall_per_save / sync_stall_s,
        "final_wait_s": r["async_loop"]["final_wait"],
        "donated_after_async_save": r["async_loop"]["donated"], "donated_after_sync_save": r["sync_loop"]["donated"],
        "loop_overhead_per_async_save_s": (r["async_loop"]["loop_s"] - loop_plain) / saves,
        "loop_overhead_per_sync_save_s": (r["sync_loop"]["loop_s"] - loop_plain) / saves,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temporary folder)")
    ap.add_argument("--mb", type=float, default=200.0, help="approximate TrainState size in MB")
    ap.add_argument("--recipe", default="fsdp", help="recipe whose shardings the state is saved from")
    ap.add_argument("--repeats", type=int, default=3, help="sync saves and raw writes to take the median of")
    ap.add_argument("--saves", type=int, default=3, help="saves in each training loop (async, then sync)")
    ap.add_argument("--every", type=int, default=4, help="training steps between saves")
    ap.add_argument("--compression", choices=[c.value for c in Compression], default=Compression.NONE.value,
                    help="chunk compression of the current settings (default: none, the Checkpointer's default)")
    ap.add_argument("--compare", action="store_true",
                    help="also measure the earlier settings (--before), alternating with the current ones")
    ap.add_argument("--before", choices=sorted(BEFORE), default="issue14",
                    help="what --compare compares with: issue14 (default: zstd, hashing with reads, a copy before sync "
                         "saves), main (Orbax's blocking part on the calling thread) or sha256 (today's save path "
                         "with a SHA-256 manifest instead of XXH3-128)")
    ap.add_argument("--busy", type=int, default=0,
                    help="run this many `yes > /dev/null` busy loops beside the benchmark (default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--max-stall-ratio", type=float, default=None,
                    help="exit 1 when the async stall exceeds this fraction of the sync save (e.g. 0.05)")
    args = ap.parse_args(argv)

    after = Setting(args.compression, mapped_hashing=True, copy_before_sync_save=False, background_start=True)
    settings = {"before": BEFORE[args.before], "after": after} if args.compare else {"after": after}
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.busy)]
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
        res = {name: {"sync": []} for name in settings}

        # raw writes and sync saves, alternating: raw, sync (before), sync (after), raw, sync (after),
        # sync (before), ... (the order flips every round, so neither setting always follows a raw write)
        raw_f, raw_b = [], []
        ckpts = {name: s.checkpointer(root / f"sync-{name}", save_every=1, keep_last=1, async_save=False)
                 for name, s in settings.items()}
        try:
            for i in range(1, args.repeats + 1):
                raw_f.append(raw_write(root, nbytes, True))
                raw_b.append(raw_write(root, nbytes, False))
                for name in (list(settings) if i % 2 else list(settings)[::-1]):
                    res[name]["sync"].append(sync_save(ckpts[name], i, state, meta))
        finally:
            for c in ckpts.values():
                c.close()
        for name in settings:
            res[name]["disk_bytes"] = sum(p.stat().st_size for p in (root / f"sync-{name}").rglob("*")
                                          if p.is_file())
        raw_fsync, raw_buffered = statistics.median(raw_f), statistics.median(raw_b)

        # the same training loop: without saves, then with async saves, then with sync saves
        steps = args.saves * args.every
        state, plain = run_loop(None, root / "plain", "plain", state, step_fn, plan, args, meta)
        for mode in ("async", "sync"):
            for name, s in settings.items():
                state, res[name][f"{mode}_loop"] = run_loop(s, root / f"{mode}-loop-{name}", mode, state, step_fn,
                                                            plan, args, meta)
        # async saves once the host CPU is idle (XLA:CPU's worker threads keep spinning for a few ms
        # after a step; on GPU/TPU the step does not run on the host, so this is the stall there)
        for name, s in settings.items():
            res[name]["idle_stalls"], res[name]["async_rss"] = idle_async_saves(
                s, root / f"idle-{name}", state, args.saves, meta)

        configs = {name: summarize(name, settings[name], res[name], nbytes, raw_fsync, raw_buffered,
                                   plain["loop_s"], args.saves) for name in settings}
        out = {
            "device": f"{len(jax.devices())} x {jax.devices()[0].platform}", "cpu_cores": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0], "busy_loops": args.busy, "recipe": plan.recipe.name,
            "layers": cfg.n_layers,
            "params": plan.abstract.num_params, "state_bytes": nbytes,
            "raw_fsync_s": raw_fsync, "raw_fsync_all_s": raw_f, "raw_fsync_MBps": nbytes / raw_fsync / 1e6,
            "raw_buffered_s": raw_buffered, "raw_buffered_MBps": nbytes / raw_buffered / 1e6,
            "step_s": plain["loop_s"] / steps, "state_buffers": len(jax.tree.leaves(state)),
            **configs["after"], "configs": configs,
        }
        if args.compare:
            b, a = configs["before"], configs["after"]
            out["compare"] = {
                "sync_save_speedup": b["sync_save_s"] / a["sync_save_s"],
                "async_stall_vs_before_sync_save": a["async_stall_s"] / b["sync_stall_in_loop_s"],
                "async_stall_idle_vs_before_sync_save": a["async_stall_idle_cpu_s"] / b["sync_stall_in_loop_s"],
            }
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        report(out)
    if args.max_stall_ratio is not None and out["stall_ratio"] > args.max_stall_ratio:
        print(f"FAIL: async stall is {out['stall_ratio']:.1%} of the sync save, above {args.max_stall_ratio:.1%}")
        raise SystemExit(1)
    return out


def report(out: dict) -> None:
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    print(f"state {mb(out['state_bytes'])} ({out['params']:,} params, {out['layers']} layers, recipe "
          f"{out['recipe']}, {out['device']}, {out['cpu_cores']} cores, load average {out['load_avg_1min']:.1f}, "
          f"{out['busy_loops']} busy loop(s))")
    print(f"raw write: {out['raw_fsync_s']:.3f} s = {out['raw_fsync_MBps']:.0f} MB/s with fsync, "
          f"{out['raw_buffered_s']:.3f} s = {out['raw_buffered_MBps']:.0f} MB/s buffered (median of "
          f"{len(out['raw_fsync_all_s'])})")
    configs = out["configs"]
    rows = [
        ("compression / on disk", lambda c: f"{c['compression']} / {mb(c['checkpoint_bytes_on_disk'])}"),
        ("background_start", lambda c: str(c["background_start"])),
        ("sync save", lambda c: f"{c['sync_save_s']:.3f} s = {c['sync_save_MBps']:.0f} MB/s"),
        ("sync save / raw fsync write", lambda c: f"{c['sync_vs_raw_fsync']:.0%} (target >= 50%)"),
        ("  all sync saves", lambda c: ", ".join(f"{s:.3f}" for s in c["sync_save_all_s"]) + " s"),
        ("peak extra RSS, sync save", lambda c: f"{mb(c['sync_save_peak_rss_extra_bytes'])} = "
                                                f"{c['sync_save_peak_rss_x_state']:.2f}x state"),
        ("peak extra RSS, async save", lambda c: f"{mb(c['async_save_peak_rss_extra_bytes'])} = "
                                                 f"{c['async_save_peak_rss_x_state']:.2f}x state (target <= 1.5x)"),
        ("async stall in loop", lambda c: ms(c["async_stall_s"])),
        ("  all async stalls", lambda c: ", ".join(f"{s * 1e3:.0f}" for s in c["async_stall_all_s"]) + " ms"),
        ("  first save / median of later", lambda c: f"{ms(c['async_stall_first_s'])} / "
                                                     f"{ms(c['async_stall_later_median_s'])} = "
                                                     f"{c['async_stall_first_s'] / c['sync_stall_in_loop_s']:.1%} / "
                                                     f"{c['async_stall_later_median_s'] / c['sync_stall_in_loop_s']:.1%}"),
        ("sync save in loop", lambda c: ms(c["sync_stall_in_loop_s"])),
        ("stall ratio (async / sync)", lambda c: f"{c['stall_ratio']:.1%} (target <= 5%)"),
        ("  counting every call", lambda c: f"{ms(c['async_stall_incl_other_calls_s'])} = "
                                            f"{c['stall_incl_other_calls_ratio']:.1%}"),
        ("async stall, CPU idle", lambda c: f"{ms(c['async_stall_idle_cpu_s'])} = {c['stall_ratio_idle_cpu']:.1%}"),
        ("donated after async / sync", lambda c: f"{c['donated_after_async_save']} / {c['donated_after_sync_save']}"
                                                 f" of {out['state_buffers']}"),
        ("loop time per save async/sync", lambda c: f"{c['loop_overhead_per_async_save_s']:+.2f} / "
                                                    f"{c['loop_overhead_per_sync_save_s']:+.2f} s (noisy)"),
    ]
    names = list(configs)
    print(f"{'':32s}" + "".join(f"{n:>44s}" for n in names))
    for label, fmt in rows:
        print(f"{label:32s}" + "".join(f"{fmt(configs[n]):>44s}" for n in names))
    if "compare" in out:
        c = out["compare"]
        print(f"sync save {c['sync_save_speedup']:.2f}x faster; async stall (after) = "
              f"{c['async_stall_vs_before_sync_save']:.1%} of the before sync save in the loop, "
              f"{c['async_stall_idle_vs_before_sync_save']:.1%} with the CPU idle")
    print(f"training loop {out['step_s']:.3f} s/step; host memory measured with {out['rss_method']}")


if __name__ == "__main__":
    main()
