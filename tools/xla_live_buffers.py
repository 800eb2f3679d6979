"""The buffers XLA keeps live at the peak of a compiled program, from its dump, with the JAX operation that made
each one: what a memory estimate is checked against, buffer by buffer.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*jit_step.*" python ...
    python tools/xla_live_buffers.py /tmp/dump                 # the newest jit_step module's peak
    python tools/xla_live_buffers.py /tmp/dump --top 60 --module jit_step

``tools/bench_plan_any_model.py --buffers DIR`` dumps its compiles and prints this after each row. Reads the
``*-live-range.txt`` XLA writes next to the optimized HLO (``Live ranges at N (peak)``), the HLO text for each
buffer's shape, operands and ``op_name``, and ``*-buffer-assignment.txt`` for the temp allocation's size (the
difference to the live bytes is the heap's fragmentation). Kinds: ``argument`` (the step's inputs: parameters,
optimizer state, batch), ``gathered weight`` (an all-gather's output),
``gathered weight (copy)`` (a layout copy of one), ``backward`` (made by a ``transpose(jvp(...))`` operation:
gradients, cotangents), ``forward`` (the rest: activations the backward still needs).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
from typing import Dict, List, NamedTuple, Tuple

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?(?:\{[^}]*\})?) ([\w\-]+)\((.*)$", re.M)
_LIVE = re.compile(r"^\s+([\w.\-]+)\{([^}]*)\}: (\d+) bytes", re.M)


class Buffer(NamedTuple):
    """One buffer live at the peak: its bytes, HLO name and shape, the HLO opcode that makes it, its first
    operands, the JAX ``op_name`` and its kind (module docstring)."""

    nbytes: int
    name: str
    shape: str
    opcode: str
    operands: Tuple[str, ...]
    op_name: str
    kind: str


def _instructions(hlo: str) -> Dict[str, Tuple[str, str, str, Tuple[str, ...]]]:
    found = {}
    for m in _INSTRUCTION.finditer(hlo):
        name, shape, opcode, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        operands = tuple(re.findall(r"%([\w.\-]+)", rest.split(")")[0]))
        found[name] = (shape, opcode, op_name.group(1) if op_name else "", operands)
    return found


def _kind(opcode: str, operands: Tuple[str, ...], op_name: str, instructions) -> str:
    if opcode == "parameter":
        return "argument"
    if opcode == "all-gather":
        return "gathered weight"
    if opcode == "fusion" and len(operands) == 1 and instructions.get(operands[0], ("", ""))[1] == "all-gather":
        return "gathered weight (copy)"
    return "backward" if "transpose(" in op_name else "forward"


def live_at_peak(prefix: str) -> Tuple[int, int, List[Buffer]]:
    """``(peak position, temp allocation bytes, buffers live at the peak)`` of the module whose dump files start
    with ``prefix`` (``.../module_0182.jit_step.cpu_after_optimizations``), largest first."""
    with open(prefix + ".txt") as f:
        instructions = _instructions(f.read())
    with open(prefix + "-live-range.txt") as f:
        ranges = f.read()
    head, _, rest = ranges.partition("(peak):")
    position = int(re.findall(r"Live ranges at (\d+)", head)[-1]) if "Live ranges at" in head else -1
    section = rest.split("Stack trace")[0]
    buffers = []
    for m in _LIVE.finditer(section):
        name, index, nbytes = m.group(1), m.group(2), int(m.group(3))
        shape, opcode, op_name, operands = instructions.get(name, ("?", "?", "", ()))
        label = name + (f"{{{index}}}" if index else "")
        buffers.append(Buffer(nbytes, label, shape, opcode, operands, op_name,
                              _kind(opcode, operands, op_name, instructions)))
    temp = 0
    assignment = prefix + "-buffer-assignment.txt"
    if os.path.exists(assignment):
        with open(assignment) as f:
            sizes = re.findall(r"^allocation \d+: size (\d+), preallocated-temp", f.read(), re.M)
        temp = sum(map(int, sizes))
    return position, temp, sorted(buffers, key=lambda b: -b.nbytes)


def newest_module(dump_dir: str, module: str = "jit_step") -> str:
    """The dump prefix of the newest module named ``module`` in ``dump_dir`` (each compile writes one)."""
    found = glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations-live-range.txt"))
    if not found:
        raise SystemExit(f"{dump_dir}: no *{module}*after_optimizations-live-range.txt (dump with XLA_FLAGS="
                         f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text)")
    newest = max(found, key=lambda p: (int(re.search(r"module_(\d+)", p).group(1)), os.path.getmtime(p)))
    return newest[: -len("-live-range.txt")]


def report(prefix: str, top: int = 30) -> str:
    """The peak's buffers as text: totals by kind, then the ``top`` largest with their shapes and ``op_name``."""
    position, temp, buffers = live_at_peak(prefix)
    live = sum(b.nbytes for b in buffers if b.kind != "argument")
    lines = [f"{os.path.basename(prefix)}: peak at instruction {position}: {live:,} B live in temp buffers "
             f"(arguments apart); temp allocation {temp:,} B (fragmentation {temp - live:,} B)"]
    kinds = collections.Counter()
    for b in buffers:
        kinds[b.kind] += b.nbytes
    lines += [f"  {n:>14,} B  {k}" for k, n in kinds.most_common()]
    for b in buffers[:top]:
        lines.append(f"  {b.nbytes:>12,}  {b.name:<28} {b.shape[:34]:<34} {b.kind:<22} {b.op_name[-100:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump_dir", help="the --xla_dump_to directory")
    ap.add_argument("--module", default="jit_step", help="the HLO module's name (default: the train step)")
    ap.add_argument("--top", type=int, default=30, help="how many of the largest buffers to list")
    args = ap.parse_args(argv)
    print(report(newest_module(args.dump_dir, args.module), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
