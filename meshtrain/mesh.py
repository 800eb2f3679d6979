"""`MeshSpec`: mesh axis names and sizes, validated, turned into a `jax.sharding.Mesh`.

Example::

    spec = MeshSpec(ici={"fsdp": -1, "tensor": 2})
    mesh = spec.build()          # on 8 devices: Mesh('fsdp': 4, 'tensor': 2), Auto axes

``ici`` sizes lay out devices within one slice / node (fast links); ``dcn`` sizes multiply them
across slices / nodes (slow links). An axis's total size is ``ici * dcn``. Axes are always
ordered as in :data:`meshtrain.axes.MESH_AXES` so that the innermost axis gets the fastest links.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Sequence, Tuple

from meshtrain.axes import MESH_AXES
from meshtrain.errors import MeshError

if TYPE_CHECKING:  # annotations only; JAX loads when a mesh is built
    import jax
    import numpy as np


class AxisTypes(str, enum.Enum):
    """Mesh axis types. Auto lets XLA propagate shardings (meshtrain's default); Explicit makes
    sharding part of the array type (``jax.sharding.reshard`` instead of constraints)."""

    AUTO = "auto"
    EXPLICIT = "explicit"

    def to_jax(self) -> jax.sharding.AxisType:
        import jax

        return jax.sharding.AxisType.Auto if self is AxisTypes.AUTO else jax.sharding.AxisType.Explicit


def _sizes(name: str, sizes: Mapping[str, int] | Sequence[Tuple[str, int]]) -> Tuple[Tuple[str, int], ...]:
    items = list(sizes.items()) if isinstance(sizes, Mapping) else [tuple(p) for p in sizes]
    seen = set()
    out = []
    for axis, size in items:
        if axis not in MESH_AXES:
            raise MeshError(f"unknown mesh axis {axis!r} in {name}; known axes: {', '.join(MESH_AXES)}")
        if axis in seen:
            raise MeshError(f"mesh axis {axis!r} appears twice in {name}; give each axis once")
        seen.add(axis)
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or (size < 1 and size != -1):
            raise MeshError(f"mesh axis {axis!r} has size {size!r} in {name}; use a positive int or -1 (the rest)")
        out.append((axis, int(size)))
    if sum(1 for _, s in out if s == -1) > 1:
        raise MeshError(f"more than one -1 in {name} ({dict(out)}); at most one axis can take 'the rest'")
    return tuple(sorted(out, key=lambda p: MESH_AXES.index(p[0])))


def _fill(name: str, sizes: Tuple[Tuple[str, int], ...], total: int) -> Dict[str, int]:
    known = math.prod(s for _, s in sizes if s != -1)
    if any(s == -1 for _, s in sizes):
        if total % known:
            raise MeshError(
                f"{name} sizes {dict(sizes)} do not divide {total} devices: the fixed axes multiply to "
                f"{known}, so -1 cannot be filled; pick sizes whose product divides {total}")
        return {a: (total // known if s == -1 else s) for a, s in sizes}
    if known != total:
        raise MeshError(
            f"{name} sizes {dict(sizes)} multiply to {known} but there are {total} devices; "
            f"make the product {total} or set one axis to -1 (JAX would silently use a subset)")
    return dict(sizes)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Mesh axes and sizes. Pass a dict; one ``-1`` per level means "the remaining devices".

    Args:
      ici: sizes within a slice or node, e.g. ``{"fsdp": -1, "tensor": 8}``.
      dcn: sizes across slices or nodes (default: none), e.g. ``{"data": 2}`` for two slices.
      axis_types: ``AxisTypes.AUTO`` (default) or ``AxisTypes.EXPLICIT``.

    Next: ``spec.build()`` for a ``Mesh`` over ``jax.devices()``, or ``spec.resolve(n)`` for the
    sizes on ``n`` devices without touching any (used by the planner for pod-sized meshes).
    """

    ici: Tuple[Tuple[str, int], ...] = ()
    dcn: Tuple[Tuple[str, int], ...] = ()
    axis_types: AxisTypes = AxisTypes.AUTO

    def __post_init__(self):
        object.__setattr__(self, "ici", _sizes("ici", self.ici))
        object.__setattr__(self, "dcn", _sizes("dcn", self.dcn))
        object.__setattr__(self, "axis_types", AxisTypes(self.axis_types))
        if not self.ici and not self.dcn:
            raise MeshError("a MeshSpec needs at least one axis, e.g. MeshSpec(ici={'data': -1})")

    @property
    def axis_names(self) -> Tuple[str, ...]:
        names = {a for a, _ in self.ici} | {a for a, _ in self.dcn}
        return tuple(a for a in MESH_AXES if a in names)

    def with_sizes(self, overrides: Mapping[str, int], *, dcn: Optional[Mapping[str, int]] = None) -> "MeshSpec":
        """A copy with some ICI sizes replaced (and optionally new DCN sizes).

        An override that sets a size drops any ``-1`` elsewhere only if the sizes no longer need it;
        ``resolve`` checks the product against the device count.
        """
        ici = dict(self.ici)
        for axis, size in overrides.items():
            if axis not in ici:
                if size == 1:
                    continue  # an axis of size 1 changes nothing
                raise MeshError(
                    f"mesh axis {axis!r} is not part of this mesh ({', '.join(self.axis_names)}); "
                    f"pick a recipe whose strategies use {axis!r}")
            ici[axis] = size
        # An explicit override of every other axis leaves a stale -1: keep it (it fills the rest).
        return dataclasses.replace(self, ici=tuple(ici.items()), dcn=self.dcn if dcn is None else tuple(dcn.items()))

    def resolve(self, num_devices: int) -> Dict[str, int]:
        """Total size per axis (ici * dcn) on ``num_devices`` devices, in canonical order."""
        dcn = dict(self.dcn)
        dcn_total = math.prod(s for s in dcn.values() if s != -1)
        if any(s == -1 for s in dcn.values()):
            raise MeshError("dcn sizes cannot use -1; give the number of slices/nodes per axis")
        if num_devices % dcn_total:
            raise MeshError(
                f"dcn sizes {dcn} multiply to {dcn_total}, which does not divide {num_devices} devices")
        ici = _fill("ici", self.ici, num_devices // dcn_total)
        return {a: ici.get(a, 1) * dcn.get(a, 1) for a in self.axis_names}

    def build(self, devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
        """Build the ``Mesh`` over ``devices`` (default ``jax.devices()``), checking every size.

        With DCN sizes the devices are grouped by slice (``device.slice_index``, via
        ``mesh_utils.create_hybrid_device_mesh``) or, where devices have no slice (GPU, CPU), by
        process: each process's devices form one ICI block, processes tile the DCN axes.
        """
        import jax

        devices = list(jax.devices() if devices is None else devices)
        sizes = self.resolve(len(devices))
        names = self.axis_names
        dcn = dict(self.dcn)
        dcn_shape = [dcn.get(a, 1) for a in names]
        ici_shape = [sizes[a] // dcn.get(a, 1) for a in names]
        from jax.experimental import mesh_utils

        if math.prod(dcn_shape) > 1:
            # CPU devices (and one-slice GPU/TPU jobs) all report slice 0: group those by process.
            slices = {getattr(d, "slice_index", None) for d in devices}
            if None not in slices and len(slices) > 1:
                try:
                    array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
                except (ValueError, NotImplementedError, AssertionError) as exc:
                    raise MeshError(f"cannot lay out ICI {dict(zip(names, ici_shape))} × DCN "
                                    f"{dict(zip(names, dcn_shape))} on {len(slices)} slices of "
                                    f"{len(devices)} {devices[0].platform} devices: {exc}") from exc
            else:
                array = _hybrid_by_process(ici_shape, dcn_shape, devices)
        else:
            try:
                array = mesh_utils.create_device_mesh(ici_shape, devices)
            except (ValueError, NotImplementedError, AssertionError) as exc:
                raise MeshError(f"cannot lay out mesh {dict(zip(names, ici_shape))} on "
                                f"{len(devices)} {devices[0].platform} devices: {exc}") from exc
        types = tuple(self.axis_types.to_jax() for _ in names)
        return jax.sharding.Mesh(array, names, axis_types=types)

    def abstract(self, num_devices: int) -> jax.sharding.AbstractMesh:
        """An ``AbstractMesh`` of the sizes on ``num_devices`` devices: plans and lowering for meshes
        larger than this machine (no devices needed)."""
        import jax

        sizes = self.resolve(num_devices)
        return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes),
                                         axis_types=tuple(self.axis_types.to_jax() for _ in sizes))

    def describe(self, num_devices: int) -> str:
        sizes = self.resolve(num_devices)
        return " × ".join(f"{a}={s}" for a, s in sizes.items())

    @classmethod
    def parse(cls, text: str) -> Dict[str, int]:
        """Parse ``"fsdp=4,tensor=2"`` into ``{"fsdp": 4, "tensor": 2}`` (the CLI's ``--mesh``)."""
        out: Dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise MeshError(f"bad --mesh entry {part!r}; write axis=size, e.g. fsdp=4,tensor=2")
            axis, _, size = part.partition("=")
            axis = axis.strip()
            if axis in out:
                raise MeshError(f"mesh axis {axis!r} given twice in {text!r}")
            try:
                out[axis] = int(size)
            except ValueError:
                raise MeshError(f"bad size {size!r} for mesh axis {axis!r}; use an int or -1") from None
        _sizes("--mesh", out)
        return out


def _hybrid_by_process(ici_shape, dcn_shape, devices) -> np.ndarray:
    """Devices grouped by process: process p's devices are DCN block p (row-major over dcn)."""
    import numpy as np

    by_process: Dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    groups = [sorted(v, key=lambda d: d.id) for _, v in sorted(by_process.items())]
    n_groups = math.prod(dcn_shape)
    per_group = math.prod(ici_shape)
    if len(groups) == 1 and len(groups[0]) == n_groups * per_group:
        # One process (tests, a single host): split its devices into equal contiguous groups.
        flat = groups[0]
        groups = [flat[i * per_group:(i + 1) * per_group] for i in range(n_groups)]
    if len(groups) != n_groups or any(len(g) != per_group for g in groups):
        raise MeshError(
            f"dcn sizes {dcn_shape} need {n_groups} groups of {per_group} devices, but the devices come "
            f"from {len(groups)} processes with {[len(g) for g in groups]} devices each; set dcn sizes to "
            f"the process count and ici sizes to the devices per process")
    ndim = len(ici_shape)
    blocks = np.array(groups, dtype=object).reshape(tuple(dcn_shape) + tuple(ici_shape))
    # Interleave (d0, i0, d1, i1, ...) so each axis is dcn-major, then merge each pair.
    order = [k for pair in zip(range(ndim), range(ndim, 2 * ndim)) for k in pair]
    return blocks.transpose(order).reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


# -- hybrid meshes: which axes cross processes / slices (DCN) --------------------------------------------------------------------------------
def granules(devices: Sequence) -> int:
    """The number of DCN groups among ``devices``: slices where devices report more than one
    ``slice_index`` (TPU multislice, GPU partitions), else processes (CPU, GPU hosts)."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) > 1:
        return len(slices)
    if devices and devices[0].platform == "tpu":
        return 1  # one slice: its hosts share the ICI
    return len({d.process_index for d in devices})


def split_dcn(spec, num_devices: int, dcn: Mapping[str, int]):
    """``spec`` with the given factors of its axes moved onto DCN, total sizes unchanged.

    ``split_dcn(hsdp_mesh, 8, {"data": 2})``: ``data=2, fsdp=4`` on 8 devices becomes ICI
    ``{data: 1, fsdp: 4}`` × DCN ``{data: 2}``: the replicas across processes/slices, FSDP within.
    """
    if spec.dcn:
        raise MeshError(f"the mesh already has DCN sizes {dict(spec.dcn)}; give DCN sizes once")
    sizes = spec.resolve(num_devices)
    ici: Dict[str, int] = dict(sizes)
    for axis, factor in dcn.items():
        if axis not in sizes:
            raise MeshError(f"DCN axis {axis!r} is not part of this mesh ({', '.join(sizes)}); "
                            f"pick one of them or a recipe that uses {axis!r}")
        if factor < 1 or sizes[axis] % factor:
            raise MeshError(f"DCN size {axis}={factor} does not divide the axis size {sizes[axis]} "
                            f"(mesh {sizes}); pick a divisor or change --mesh")
        ici[axis] = sizes[axis] // factor
    return MeshSpec(ici=ici, dcn={a: f for a, f in dcn.items() if f > 1} or {}, axis_types=spec.axis_types)


def auto_dcn(spec, devices: Sequence):
    """Put the mesh's outermost axes across processes/slices when ``devices`` span several.

    A spec that already has DCN sizes, or devices of one granule, come back unchanged. Otherwise
    axes are taken outermost first (``stage``, ``data``, ``fsdp``, ...) and as much of each as the
    granule count needs goes to DCN: ``hsdp`` (``data=2, fsdp=-1``) on 2 processes × 4 devices →
    DCN ``{data: 2}``, ICI ``{data: 1, fsdp: 4}``; ``fsdp`` → DCN ``{fsdp: 2}``, ICI ``{fsdp: 4}``.
    """
    g = granules(devices)
    if spec.dcn or g <= 1:
        return spec
    sizes = spec.resolve(len(devices))
    left, dcn = g, {}
    for axis, size in sizes.items():
        f = math.gcd(size, left)
        if f > 1:
            dcn[axis] = f
            left //= f
    if left > 1:
        raise MeshError(f"mesh {sizes} cannot be spread over {g} processes/slices (a factor {left} is left); "
                        f"make an outer axis a multiple of {g} with --mesh")
    return split_dcn(spec, len(devices), dcn)


def hybrid_layout(spec, devices: Sequence, dcn: Optional[str] = None):
    """The mesh spec for ``devices``: ``dcn`` (``"data=2"``: that much of each axis across
    processes/slices) when given, else :func:`auto_dcn`."""
    return split_dcn(spec, len(devices), MeshSpec.parse(dcn)) if dcn else auto_dcn(spec, devices)


def select_devices(requested: Optional[int]) -> list:
    """All devices, or the first ``requested``: of the machine, or of each process in a multi-process
    run (``--devices`` counts per process there, like the CPU simulation's device count)."""
    import jax

    devices = jax.devices()
    if requested is None:
        return devices
    if jax.process_count() > 1:
        mine = [d for d in devices if d.process_index == jax.process_index()]
        if requested > len(mine):
            raise MeshError(f"--devices {requested} (per process) but process {jax.process_index()} has only "
                              f"{len(mine)} {mine[0].platform} devices; lower --devices")
        chosen = {d.id for p in range(jax.process_count())
                  for d in [d for d in devices if d.process_index == p][:requested]}
        return [d for d in devices if d.id in chosen]
    if requested > len(devices):
        raise MeshError(f"--devices {requested} but only {len(devices)} {devices[0].platform} devices exist; lower --devices (CPU devices are simulated only without an accelerator)")
    return devices[:requested]
