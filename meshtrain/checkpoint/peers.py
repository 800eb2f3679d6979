"""In-memory peer checkpoints (``--peer-every M``): every M steps each process keeps its own shards
of the train state in host memory and a copy of its predecessor's, so that a restart after one
process failed resumes from step M·k instead of the last disk checkpoint.

**Where "host memory" lives.** A restart (``meshtrain launch --max-restarts``, a cluster's requeue)
starts new processes, so the copies must outlive the process that made them: each process writes
them to a RAM-backed folder, ``/dev/shm`` (``MESHTRAIN_PEER_DIR`` overrides it; the system's
temporary folder where there is no ``/dev/shm``)::

    <root>/meshtrain-peers-<hash of the checkpoint folder>/process-<i>/<step>/
        own.bin    process i's shards (each distinct shard once; replicas on its devices are skipped)
        held.bin   process i-1's own.bin, received through a collective permute (the accelerators'
                   links, as the training step's collectives): on another host in a real cluster

Each ``.bin`` is self-checking: a header (step, process, process count, the run's token, every
shard's path, index, shape, dtype, offset; the data position and metadata) and the sha256 of the
data. A copy is used only when its checksum, header and token match; ``<step>`` folders appear by an
atomic rename, so a process killed while writing leaves no partial step. The newest
:data:`KEEP` steps are kept, so host memory holds ``2 × KEEP`` × this process's shard bytes.

**Restore.** The processes agree (a broadcast and an all-gather of a few integers) on the newest
step that every process can rebuild, from its own copy or from the copy its successor holds (the
lost host's shards), and take it when it is newer than the newest valid disk step; a process whose
own copy is lost or damaged gets it back from its successor (a collective permute the other way).
Peers cannot serve another process count, mesh or dtype (elastic shrinking, a changed recipe): then,
as when no step is complete, the disk checkpoint is restored. The token (``checkpoints/peers.json``,
made by process 0 when the folder has none) ties the copies to this run folder: a deleted and
recreated run at the same path never restores another run's copies.

Orbax 0.12's ``experimental.emergency`` managers need a replica axis (a slice holding a full copy
of the state, restored by broadcast) or an external replicator service; an FSDP run over two
processes holds no full replica, hence this module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import secrets
import shutil
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.checkpoint.housekeeping import warn
from meshtrain.checkpoint.layout import _is_key, flat_paths
from meshtrain.checkpoint.peer_folders import ENV_PEER_DIR, peer_root, process_folder, store_folder  # noqa: F401
from meshtrain.checkpoint.types import Restored
from meshtrain.state import abstract_train_state

#: Steps kept per process (own + held copy each): a process killed while writing one leaves the other.
KEEP = 2
TOKEN_FILE = "peers.json"
_PAD = 1 << 20   # exchanged buffers are padded to whole MiB: one compiled permute per state size
_PREFIX = struct.Struct("<QQ")   # header bytes, data bytes

Index = Tuple[Tuple[int, int], ...]


# -- one copy: encoding and checking -------------------------------------------------------------------
def _index(index, shape) -> Index:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))


def _leaves(state):
    """``(path, array)`` with PRNG key arrays as their raw uint32 words."""
    for path, x in flat_paths(state):
        yield path, (jax.random.key_data(x) if _is_key(x.dtype) else x)


def encode(state, *, step: int, process: int, processes: int, token: int, data_state: Dict[str, Any],
           metadata: Dict[str, Any]) -> np.ndarray:
    """This process's distinct shards of ``state`` as one self-checking uint8 buffer."""
    entries, chunks, offset = [], [], 0
    for path, x in _leaves(state):
        seen = set()
        for shard in x.addressable_shards:
            index = _index(shard.index, x.shape)
            if index in seen:
                continue
            seen.add(index)
            data = np.array(shard.data, order="C")   # (np.ascontiguousarray turns a scalar into shape (1,))
            entries.append({"path": path, "index": index, "shape": list(data.shape), "dtype": data.dtype.str,
                            "offset": offset, "bytes": data.nbytes})
            chunks.append(data.reshape(-1).view(np.uint8))
            offset += data.nbytes
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    header = json.dumps({"step": step, "process": process, "processes": processes, "token": token,
                         "sha256": hashlib.sha256(data).hexdigest(), "entries": entries,
                         "data_state": data_state, "metadata": metadata}).encode()
    return np.concatenate([np.frombuffer(_PREFIX.pack(len(header), data.nbytes), np.uint8),
                           np.frombuffer(header, np.uint8), data])


@dataclasses.dataclass(frozen=True)
class Copy:
    """A checked copy: its header and its data bytes."""

    header: Dict[str, Any]
    data: np.ndarray

    def shards(self) -> Dict[Tuple[str, Index], np.ndarray]:
        out = {}
        for e in self.header["entries"]:
            raw = self.data[e["offset"]:e["offset"] + e["bytes"]]
            out[(e["path"], tuple(tuple(i) for i in e["index"]))] = raw.view(np.dtype(e["dtype"])).reshape(e["shape"])
        return out


def decode(buffer: np.ndarray) -> Tuple[Optional[Copy], str]:
    """``(copy, "")`` when ``buffer`` (trailing padding allowed) passes its checks, else ``(None, why)``."""
    buffer = np.asarray(buffer, np.uint8).reshape(-1)
    if buffer.size < _PREFIX.size:
        return None, f"{buffer.size} bytes: shorter than its header"
    header_bytes, data_bytes = _PREFIX.unpack(buffer[:_PREFIX.size].tobytes())
    end = _PREFIX.size + header_bytes + data_bytes
    if end > buffer.size:
        return None, f"truncated: {buffer.size} bytes, the header says {end}"
    try:
        header = json.loads(buffer[_PREFIX.size:_PREFIX.size + header_bytes].tobytes())
    except (UnicodeDecodeError, ValueError):
        return None, "unreadable header"
    data = buffer[_PREFIX.size + header_bytes:end]
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        return None, "checksum mismatch"
    return Copy(header, data), ""


# -- the exchange ------------------------------------------------------------------------------------
def exchange(buffer: np.ndarray, shift: int) -> np.ndarray:
    """Send ``buffer`` to process ``i + shift`` and return what process ``i - shift`` sent (every
    process calls it): a collective permute over one device per process."""
    n = jax.process_count()
    if n == 1:
        return buffer.copy()
    longest = int(np.max(multihost_utils.process_allgather(np.int32(-(-buffer.size // _PAD)))))
    width = max(longest, 1) * _PAD
    devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
    mesh = Mesh(np.array(devices), ("peers",))
    sharding = NamedSharding(mesh, PartitionSpec("peers"))
    row = np.zeros((1, width), np.uint8)
    row[0, :buffer.size] = buffer
    mine = jax.device_put(row, devices[jax.process_index()])
    arr = jax.make_array_from_single_device_arrays((n, width), sharding, [mine])
    out = _permute(mesh, tuple((p, (p + shift) % n) for p in range(n)))(arr)
    return np.asarray(out.addressable_shards[0].data)[0]


@functools.lru_cache(maxsize=8)   # one compiled permute per mesh, direction and buffer width
def _permute(mesh: Mesh, perm):
    spec = PartitionSpec("peers")
    return jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "peers", perm), mesh=mesh, in_specs=spec,
                                 out_specs=spec))


# -- the store ---------------------------------------------------------------------------------------
class PeerStore:
    """This process's copies of one run (see the module docstring). Every process calls
    :meth:`save`, :meth:`latest` and :meth:`restore` at the same points: they hold collectives."""

    def __init__(self, checkpoint_dir: Path, every: int, root: Optional[Path] = None):
        self.checkpoint_dir, self.every = Path(checkpoint_dir), every
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.folder = process_folder(self.checkpoint_dir, self.process, root)
        self._latest: Optional[Tuple[Optional[int], int]] = None   # (step, token), until the next save
        self._warned: set = set()   # copies already reported as unusable
        self._token = self._own_token() if self.process == 0 else 0
        self._shared = False   # whether the other processes have the token yet

    def _own_token(self) -> int:
        """Process 0: this run folder's token, made on first use."""
        path = self.checkpoint_dir / TOKEN_FILE
        try:
            return int(json.loads(path.read_text())["token"])
        except (OSError, ValueError, KeyError, TypeError):
            token = secrets.randbelow(2 ** 31 - 1) + 1
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"token": token}))
            os.replace(tmp, path)
            return token

    def _token_everywhere(self) -> int:
        """Process 0's token, on every process (one broadcast, the first time)."""
        if self.processes > 1 and not self._shared:
            self._token = int(multihost_utils.broadcast_one_to_all(np.int32(self._token)))
        self._shared = True
        return self._token

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, state, *, data_state: Dict[str, Any], metadata: Dict[str, Any]) -> None:
        """Keep this process's shards of ``step`` and its predecessor's (collective)."""
        token = self._token_everywhere()
        own = encode(state, step=step, process=self.process, processes=self.processes, token=token,
                     data_state=data_state, metadata=metadata)
        held = exchange(own, +1)
        held = held[:_length(held)]   # without the exchange's padding
        self._latest = None
        tmp, final = self.folder / f"{step}.tmp", self.folder / str(step)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            own.tofile(tmp / "own.bin")
            held.tofile(tmp / "held.bin")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as exc:   # a full /dev/shm must not stop training: the older copies and the disk remain
            shutil.rmtree(tmp, ignore_errors=True)
            warn(f"cannot keep the in-memory peer copies of step {step} in {self.folder}: {exc.strerror or exc}; "
                 f"a restart uses older copies or the disk checkpoint")
            return
        for old in self.steps()[:-KEEP]:
            shutil.rmtree(self.folder / str(old), ignore_errors=True)

    def steps(self) -> List[int]:
        """The committed step folders of this process, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(int(p.name) for p in self.folder.iterdir() if p.name.isdigit())

    def _read(self, step: int, which: str, token: int) -> Optional[Copy]:
        """``which`` (own/held) of ``step`` when it passes its checks for this run, else None (said)."""
        owner = self.process if which == "own" else (self.process - 1) % self.processes
        path = self.folder / str(step) / f"{which}.bin"
        try:
            buffer = np.fromfile(path, np.uint8)
        except OSError:
            return None
        copy, why = decode(buffer)
        if copy is not None:
            h = copy.header
            why = ("another run's copy (token differs)" if h.get("token") != token else
                   f"holds step {h.get('step')}" if h.get("step") != step else
                   f"holds process {h.get('process')} of {h.get('processes')}, not {owner} of {self.processes}"
                   if (h.get("process"), h.get("processes")) != (owner, self.processes) else "")
        if why:
            if (path, why) not in self._warned:
                self._warned.add((path, why))
                warn(f"peer copy {path} is not used: {why}")
            return None
        return copy

    def latest(self) -> Optional[int]:
        """The newest step every process can rebuild from the copies (collective; cached until a save)."""
        token = self._token_everywhere()
        if self._latest is not None and self._latest[1] == token:
            return self._latest[0]
        report = np.full((2, KEEP), -1, np.int32)
        if token:
            for row, which in enumerate(("own", "held")):
                good = [s for s in self.steps() if self._read(s, which, token) is not None][-KEEP:]
                report[row, :len(good)] = good
        every = np.asarray(multihost_utils.process_allgather(report)).reshape(self.processes, 2, KEEP) \
            if self.processes > 1 else report[None]
        n = self.processes
        candidates = sorted({int(s) for s in every.ravel() if s >= 0}, reverse=True)
        step = next((s for s in candidates
                     if all(s in every[i, 0] or s in every[(i + 1) % n, 1] for i in range(n))), None)
        self._latest = (step, token)
        return step

    def restore(self, plan, step: int) -> Optional[Restored]:
        """``step`` rebuilt on ``plan``'s shardings from the copies, or None when some process cannot
        (another mesh or process count, a missing shard): then every process falls back to disk."""
        token = self._token_everywhere()
        own = self._read(step, "own", token)
        held = self._read(step, "held", token)
        need = np.int32(own is None)
        wanted = (np.asarray(multihost_utils.process_allgather(need)).reshape(-1) if self.processes > 1
                  else np.array([need]))
        if wanted.any():   # the successor of each process that lost its copy sends that copy back
            sent = exchange(_raw(self.folder / str(step) / "held.bin") if held is not None
                            else np.zeros(0, np.uint8), -1)
            if own is None:
                own, _ = decode(sent)
                if own is not None and (own.header.get("token"), own.header.get("step"),
                                        own.header.get("process")) != (token, step, self.process):
                    own = None
        state = _build(abstract_train_state(plan), own.shards()) if own is not None else None
        ok = np.int32(state is not None)
        everywhere = (np.asarray(multihost_utils.process_allgather(ok)).reshape(-1) if self.processes > 1
                      else np.array([ok]))
        if not everywhere.all():
            return None
        return Restored(step, state, dict(own.header.get("data_state") or {}), own.header.get("metadata") or {})

    def discard(self) -> None:
        """Remove this process's copies (the disk holds a step at least as new); process 0 also those
        of process numbers this run no longer has (left by an elastic shrink); the last one out removes
        the run's folder."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.process == 0 and self.folder.parent.is_dir():
            for other in self.folder.parent.glob("process-*"):
                if not other.name[len("process-"):].isdigit() or int(other.name[len("process-"):]) >= self.processes:
                    shutil.rmtree(other, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:   # another process's copies are still there (it removes them itself)
            pass


def _length(buffer: np.ndarray) -> int:
    """Bytes of the copy at the start of ``buffer`` (what follows is padding); all of it if unreadable."""
    if buffer.size < _PREFIX.size:
        return buffer.size
    header_bytes, data_bytes = _PREFIX.unpack(buffer[:_PREFIX.size].tobytes())
    return min(buffer.size, _PREFIX.size + header_bytes + data_bytes)


def _raw(path: Path) -> np.ndarray:
    try:
        return np.fromfile(path, np.uint8)
    except OSError:
        return np.zeros(0, np.uint8)


def _build(target, shards: Dict[Tuple[str, Index], np.ndarray]):
    """The state of ``target`` (ShapeDtypeStructs with shardings) from this process's shards, or
    None when one is missing or has another shape or dtype."""
    leaves = []
    for path, t in flat_paths(target):
        key = _is_key(t.dtype)
        like = jax.eval_shape(jax.random.key_data, t) if key else t
        sharding = (NamedSharding(t.sharding.mesh, PartitionSpec(*t.sharding.spec, *([None] * (like.ndim - t.ndim))))
                    if key else t.sharding)
        indices = sharding.addressable_devices_indices_map(like.shape).values()
        wanted = [shards.get((path, _index(i, like.shape))) for i in indices]
        if any(d is None or d.dtype != np.dtype(like.dtype) for d in wanted):
            return None
        try:
            arr = jax.make_array_from_callback(like.shape, sharding,
                                               lambda index: shards[(path, _index(index, like.shape))])
        except (ValueError, TypeError):
            return None
        if key:
            impl = t.dtype._impl   # the key's implementation (threefry2x32 by default)
            arr = jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=t.sharding)(arr)
        leaves.append(arr)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)
