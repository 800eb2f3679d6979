"""Pre-flight memory check: before anything is allocated, compare the plan's per-device bytes with
what a device has, and refuse (with what to change) instead of being killed half-way through init.

Estimate: parameters + gradients + optimizer state + batch from the plan, or what an ``estimate``
function says (``meshtrain train`` passes the planner's :func:`meshtrain.analysis.estimate_memory`
for the built-in decoders: saved activations and the backward working set too). Limit: an accelerator's ``memory_stats()["bytes_limit"]``; on CPU
the host's physical memory divided among this process's simulated devices (they share it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Tuple

from meshtrain.errors import ConfigError

#: The estimate may use at most this share of the limit (XLA's fragmentation, runtime buffers).
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    estimate_bytes: int
    limit_bytes: Optional[int]
    detail: str

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.estimate_bytes <= HEADROOM * self.limit_bytes


def device_memory_limit(device, local_devices: int) -> Optional[int]:
    """Bytes one device may use: the accelerator's limit, or host RAM ÷ simulated CPU devices."""
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without memory stats: no check
            return None
        return stats.get("bytes_limit")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return ram // max(local_devices, 1)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


#: ``plan -> (bytes per device, what they are)``: a fuller estimate than the plan's own bytes.
Estimate = Callable[[Any], Tuple[int, str]]


def estimate_bytes(plan, estimate: Optional[Estimate] = None) -> MemoryCheck:
    """The plan's per-device bytes: ``estimate``'s figure when one is given, else parameters, gradients,
    optimizer and batch.

    The full estimate is not gated on the cheap bound: activations and the logits grow with batch ×
    sequence (× vocabulary) while the cheap bound grows with the batch's token ids only, so a huge batch
    of short sequences (``--batch-size 1000000 --seq-len 8``: 16 MB of token ids, 16 GiB of activations per
    device) passed a gate "cheap bound > 30 % of the limit" and died in XLA's allocator instead."""
    if estimate is not None:
        total, parts = estimate(plan)
        return MemoryCheck(int(total), None, parts)
    per = plan.per_device_bytes()
    cheap = 2 * per["params"] + per["optimizer"] + per["batch"]
    detail = (f"parameters {_gib(per['params'])} + gradients {_gib(per['params'])} + optimizer "
              f"{_gib(per['optimizer'])} + batch {_gib(per['batch'])}")
    return MemoryCheck(int(cheap), None, detail)


def check_memory(plan, estimate: Optional[Estimate] = None, *, remat: str = "none") -> MemoryCheck:
    """Raise :class:`ConfigError` when the plan does not fit one device, naming the estimate, the
    limit and what to change. Returns the check (``limit_bytes`` ``None``: unknown, not checked)."""
    import jax

    device = plan.mesh.devices.flat[0]
    local = sum(1 for d in plan.mesh.devices.flat if d.process_index == jax.process_index())
    limit = device_memory_limit(device, local)
    if limit is None:
        return estimate_bytes(plan)
    check = estimate_bytes(plan, estimate)
    check = dataclasses.replace(check, limit_bytes=int(limit))
    if check.fits:
        return check
    where = (f"host RAM {_gib(limit * local)} shared by {local} simulated CPU devices" if device.platform == "cpu"
             else f"{device.device_kind} memory")
    raise ConfigError(
        f"the plan needs ~{_gib(check.estimate_bytes)} per device ({check.detail}) but a device has "
        f"{_gib(limit)} ({where}; {HEADROOM:.0%} usable). Change one of: a recipe that shards more "
        f"(--recipe fsdp or fsdp_tp), more devices or a larger --mesh, --remat full (now {remat}), "
        f"--grad-accum (or --pipeline-micro-batches), a smaller --batch-size/--seq-len, or a smaller --model. See "
        f"`meshtrain plan --model ... --recipe auto` for a layout that fits; --memory-check off skips this check")
