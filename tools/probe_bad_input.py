"""Probe the CLI as a hostile user would: every bad-input and fault case of issue 18, each in a fresh
process, with its exit status, whether a traceback was printed, and the first line it said.

    python tools/probe_bad_input.py                 # all groups (121 cases, ~7 min on 2 busy cores), a Markdown table
    python tools/probe_bad_input.py --only recipe   # the cases whose name contains 'recipe'
    python tools/probe_bad_input.py --json out.json
    python tools/probe_bad_input.py --group data     # one group of tools/probe_groups/ (see GROUPS)
    python tools/probe_bad_input.py --group hf --share-process   # CLI-only cases in one child (probe_worker.py)

Groups: the cases above (issue 18) are group ``cli``; each module of ``tools/probe_groups/`` adds a
group (``cases(tmp) -> List[Case]``), and each group has a test (``tests/test_probe_<group>.py``).
Every case runs in a fresh folder of its own (``{work}`` in its argv, shell or Python text; ``prepare``
fills it first). Beyond the exit status and the traceback, a case is judged on what it left: no
pre-existing file under its folder changed, nothing at its ``out`` when it failed, no process
started by it alive (each carries ``MESHTRAIN_PROBE_CASE`` in its environment) and no new
``/dev/shm/meshtrain-*`` entry.

A case passes when its status is the expected one and no traceback was printed; a `warn` case must
also print a `warning:` line, an `ok` case (valid input that used to be refused) must exit 0. The
tool exits 1 when any case fails. Full-disk cases mount a 4 MiB tmpfs and are skipped when not root.
Ctrl-C races (a SIGINT inside an async save or a pipeline compile) are timing-dependent and are
covered by tests/test_faults.py and tests/test_checkpoint_safety.py instead.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from probe_worker import Worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["train", "--model", "tiny", "--steps", "2", "--log-every", "1", "--progress", "none",
         "--eval-every", "0", "--ckpt-every", "0"]


@dataclass
class Case:
    name: str
    argv: Sequence[str]            # meshtrain arguments, or a full command when `shell` is set
    expect: str                    # "2", "74", "0" (valid input), "warn" (0 + a warning line)
    shell: Optional[str] = None    # a bash prefix (e.g. `ulimit -f 8`) run before meshtrain
    setup: Optional[str] = None    # name of a setup step (see Probe.setup)
    python: Optional[str] = None   # run this Python snippet instead of the CLI
    needs_root: bool = False
    #: fills the case's fresh folder (its one argument) before the run; its files must not change
    prepare: Optional[Callable[[str], None]] = None
    #: a path (``{work}`` allowed) that must not exist after the run unless the case exits 0
    out: Optional[str] = None
    #: send SIGINT once this path (``{work}`` allowed; a glob) exists, then expect exit 130
    interrupt_when: Optional[str] = None
    #: a text the output must contain (e.g. the file the error names)
    says: Optional[str] = None
    #: extra environment for the run
    env: Optional[dict] = None
    group: str = "cli"
    result: dict = field(default_factory=dict)


def _recipe(tmp: str, name: str, text: str, binary: bytes = b"") -> str:
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        f.write(binary or textwrap.dedent(text).encode())
    return path


def cases(tmp: str) -> List[Case]:
    base = "name: mine\nstrategies: [fsdp]\nmesh:\n  ici: {fsdp: -1}\n"
    r = lambda n, t: _recipe(tmp, n, t)  # noqa: E731
    moe = ("import meshtrain as mt, sys\n"
           "try:\n    mt.models.get_config('tiny-moe', {kw})\n"
           "except mt.errors.MeshtrainError as e:\n    print('error:', e, file=sys.stderr); sys.exit(2)\n")
    out = []
    # recipe files
    out += [
        Case("recipe: axis_types sideways", ["plan", "--model", "tiny", "--recipe",
             r("axis.yaml", "name: mine\nstrategies: [fsdp]\nmesh:\n  ici: {fsdp: -1}\n  axis_types: sideways\n")], "2"),
        Case("recipe: a rule's mesh axis is an integer", ["plan", "--model", "tiny", "--recipe",
             r("int.yaml", base + "rules:\n  params: {embed: 3}\n")], "2"),
        Case("recipe: file not UTF-8", ["plan", "--model", "tiny", "--recipe",
             _recipe(tmp, "latin1.yaml", "", binary=(base + "description: caf\xe9\n").encode("latin-1"))], "2"),
        Case("recipe: duplicated key", ["plan", "--model", "tiny", "--recipe",
             r("dup.yaml", base + "remat: full\nremat: none\n")], "2"),
        Case("recipe: typo in replicate_indivisible", ["plan", "--model", "tiny", "--recipe",
             r("typo.yaml", base + "replicate_indivisible: [kv_head]\n")], "2"),
        Case("recipe: MoE capacity_factor in a recipe file", ["plan", "--model", "tiny-moe", "--recipe",
             r("moe.yaml", base + "capacity_factor: 0\n")], "2"),
    ]
    # MoE settings (Python API: the model's config)
    for label, kw in [("capacity_factor 0", "capacity_factor=0"), ("capacity_factor -1", "capacity_factor=-1"),
                      ("capacity_factor nan", "capacity_factor=float('nan')"),
                      ("capacity_factor inf", "capacity_factor=float('inf')"),
                      ("capacity_factor a string", "capacity_factor='1.25'"),
                      ("top_k 0", "experts_per_token=0"), ("top_k > experts", "experts_per_token=99"),
                      ("negative n_shared", "n_shared_experts=-1")]:
        out.append(Case(f"moe: {label}", [], "2", python=moe.format(kw=kw)))
    out.append(Case("moe: capacity_factor 1e6 trains (capacity stops at seq_len)", [], "0", python=(
        "import sys\nimport meshtrain as mt\nfrom meshtrain.train import Trainer, TrainConfig\n"
        "cfg = mt.models.get_config('tiny-moe', capacity_factor=1e6)\n"
        "Trainer(TrainConfig(model='tiny-moe', recipe='ep', steps=1, eval_every=0, progress='none', out=sys.argv[1]),"
        " model=mt.models.model_factory(cfg)).run()\n")))
    # memory pre-flight
    out.append(Case("train: huge batch at a small sequence length",
                    [*TRAIN, "--batch-size", "1000000", "--seq-len", "8"], "2"))
    # plan flags
    for flag, value in (("--seq-len", "0"), ("--batch-size", "0"), ("--slices", "0")):
        out.append(Case(f"plan {flag} {value}", ["plan", "--model", "tiny", "--recipe", "fsdp", flag, value], "2"))
    out.append(Case("plan --top -1", ["plan", "--model", "tiny", "--recipe", "auto", "--top", "-1"], "2"))
    out.append(Case("plan: seq-len above a decoder's maximum", ["plan", "--model", "tiny", "--recipe", "fsdp",
                                                                "--seq-len", "100000"], "warn"))
    out.append(Case("plan: seq-len above bert's position table", ["plan", "--model", "bert-tiny", "--recipe",
                                                                  "dp", "--seq-len", "1000"], "2"))
    # train flags
    out += [
        Case("train --attention ring without a context axis", [*TRAIN, "--recipe", "fsdp", "--attention", "ring"], "2"),
        Case("train --schedule without pipeline stages", [*TRAIN, "--recipe", "fsdp", "--schedule", "1f1b"], "2"),
        Case("train --seq-len for vit", ["train", "--model", "vit-tiny", "--steps", "1", "--seq-len", "64"], "2"),
        Case("train --peak-tflops -5", [*TRAIN, "--peak-tflops", "-5"], "2"),
        Case("train --dcn data=2 in one process", [*TRAIN, "--recipe", "hsdp", "--dcn", "data=2"], "warn"),
        Case("launch --grace -1", ["launch", "--processes", "1", "--grace", "-1", "--", "recipes"], "2"),
        Case("launch --processes 64 on this host", ["launch", "--processes", "64", "--", *TRAIN], "2"),
    ]
    # valid input that used to be refused
    out += [
        Case("bert-tiny under cp", ["train", "--model", "bert-tiny", "--recipe", "cp", "--steps", "2",
                                    "--progress", "none", "--eval-every", "0", "--ckpt-every", "0"], "0"),
        Case("bert-tiny under fsdp_cp_usp", ["train", "--model", "bert-tiny", "--recipe", "fsdp_cp_usp", "--steps",
                                             "2", "--progress", "none", "--eval-every", "0", "--ckpt-every", "0"], "0"),
        Case("ulysses on 5 context devices (names the counts that work)",
             [*TRAIN, "--recipe", "cp", "--attention", "ulysses", "--devices", "5", "--seq-len", "160"], "2"),
    ]
    # damaged metrics.jsonl on --resume (setup: a finished 4-step run, then damage)
    for label in ("binary garbage", "a garbage line", "a non-integer step", "a null checkpoint step", "a folder"):
        out.append(Case(f"resume: metrics.jsonl with {label}", [], "2", setup=f"damaged:{label}"))
    out.append(Case("resume: fsdp f32 run with --param-dtype bfloat16 (says so)", [], "0", setup="dtype"))
    # file-size limit and full disk
    out += [
        Case("ulimit -f: plan.json", [], "74", shell="ulimit -f 8", setup="plain"),
        Case("ulimit -f: checkpoint", [], "74", shell="ulimit -f 200", setup="ckpt"),
        Case("full disk (4 MiB tmpfs): checkpoint", [], "74", setup="tmpfs", needs_root=True),
    ]
    return out


#: The groups of tools/probe_groups/ (module names), each with its test tests/test_probe_<group>.py.
GROUPS = tuple(sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "tools", "probe_groups"))
                      if name.endswith(".py") and not name.startswith("_")))


def all_cases(tmp: str, group: Optional[str] = None) -> List[Case]:
    """The cases of ``group`` (``cli``: this file's; a module of tools/probe_groups/), or of all groups."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    found = []
    for name in ([group] if group else ["cli", *GROUPS]):
        if name == "cli":
            found += cases(tmp)
            continue
        for case in importlib.import_module(f"probe_groups.{name}").cases(tmp):
            case.group = name
            found.append(case)
    return found


def shareable(case: Case) -> bool:
    """Whether ``case`` is only CLI arguments, so that ``--share-process`` may run it in the shared
    child (tools/probe_worker.py): no shell prefix (a resource limit), Python snippet, setup, signal,
    extra environment or mount."""
    return not (case.shell or case.python or case.setup or case.interrupt_when or case.env or case.needs_root)


def child_env() -> dict:
    """The environment of each case's process: this one's on CPU, without a device count (a case gets
    the CLI's own default) and without other XLA flags, except the compiler's optimization level (the
    test suite's ``-O0``, tests/processes.py, which cuts compile CPU by a third and changes no check)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    levels = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
    if levels:
        env["XLA_FLAGS"] = " ".join(levels)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def made_once(name: str, tmp: str, make: Callable[[str], None]) -> str:
    """The folder ``make(folder)`` fills (a trained or imported run several cases copy), made once per
    probe, or once per test session where ``$MESHTRAIN_PROBE_MADE`` names a folder that probes share
    (tests/probe_group.py sets it: the groups' runs are then made once for all their tests)."""
    import fcntl

    root = os.environ.get("MESHTRAIN_PROBE_MADE") or tmp
    os.makedirs(root, exist_ok=True)
    folder = os.path.join(root, name)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another probe making it meanwhile: wait for it
        try:
            if not os.path.exists(folder + ".done"):
                shutil.rmtree(folder, ignore_errors=True)
                make(folder)
                open(folder + ".done", "w").close()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def vit_tiny_run(tmp: str) -> str:
    """A 1-step ``vit-tiny`` run with its checkpoint: a run that is not a decoder's (groups hf, inputs)."""
    def make(target: str) -> None:
        argv = ["train", "--model", "vit-tiny", "--steps", "1", "--ckpt-every", "1", "--progress", "none",
                "--eval-every", "0", "--devices", "1", "--out", target]
        done = subprocess.run([sys.executable, "-m", "meshtrain", *argv], capture_output=True, text=True,
                              env=child_env(), timeout=900)
        if done.returncode:
            raise SystemExit(f"probe: training the vit-tiny run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return made_once("vit-tiny-1-step", tmp, make)


class Probe:
    def __init__(self, tmp: str, timeout: float, share_process: bool = False):
        self.tmp, self.timeout = tmp, timeout
        self.env = child_env()
        self._finished = None
        self.worker = Worker(self.env, tmp) if share_process else None

    def _exec(self, cmd: List[str], shell: Optional[str] = None, case: Optional[Case] = None,
              work: Optional[str] = None):
        if shell:
            cmd = ["bash", "-c", f'{shell}; exec "$@"', "bash", *cmd]
        env = dict(self.env, MESHTRAIN_PROBE_CASE=self.marker(case))
        env.update((case.env or {}) if case else {})
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=work or self.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        if case is not None and case.interrupt_when:
            pattern = _fill(case.interrupt_when, work)
            while proc.poll() is None and time.monotonic() - t0 < self.timeout and not glob.glob(pattern):
                time.sleep(0.02)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=max(1.0, self.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate(timeout=30)
            return 124, out, err + f"\n(killed after {self.timeout:.0f} s)", time.monotonic() - t0
        return proc.returncode, out, err, time.monotonic() - t0

    def marker(self, case: Optional[Case]) -> str:
        return f"{os.getpid()}:{case.name if case else '-'}"

    def cli(self, argv, shell=None):
        return self._exec([sys.executable, "-m", "meshtrain", *map(str, argv)], shell)

    def finished_run(self) -> str:
        """A 4-step fsdp run with checkpoints at 2 and 4, made once and copied per case."""
        if self._finished is None:
            self._finished = os.path.join(self.tmp, "finished")
            code, _, err, _ = self.cli(["train", "--model", "tiny", "--steps", "4", "--ckpt-every", "2",
                                        "--progress", "none", "--eval-every", "0", "--out", self._finished])
            if code != 0:
                raise SystemExit(f"probe setup failed (exit {code}): {err[-2000:]}")
        return self._finished

    def run(self, case: Case, work: str):
        """Runs ``case`` in its folder ``work`` (made and prepared by :meth:`judged`)."""
        if case.python:
            argv = [sys.executable, "-c", _fill(case.python, work), os.path.join(self.tmp, case.name.replace(" ", "_"))]
            return self._exec(argv, _fill(case.shell, work) if case.shell else None, case, work)
        if self.worker is not None and shareable(case):
            return self.worker.run([_fill(str(a), work) for a in case.argv], work, self.marker(case), self.timeout)
        if case.setup is None:
            return self._exec([sys.executable, "-m", "meshtrain", *(_fill(str(a), work) for a in case.argv)],
                              _fill(case.shell, work) if case.shell else None, case, work)
        kind = case.setup
        folder = os.path.join(self.tmp, "run-" + "".join(c if c.isalnum() else "_" for c in case.name))
        shutil.rmtree(folder, ignore_errors=True)
        if kind.startswith("damaged:"):
            shutil.copytree(self.finished_run(), folder)
            path = os.path.join(folder, "metrics.jsonl")
            lines = open(path).read().splitlines(keepends=True)
            label = kind.split(":", 1)[1]
            if label == "binary garbage":
                with open(path, "ab") as f:
                    f.write(b"\xff\xfe\x00garbage\n")
            elif label == "a garbage line":
                lines.insert(2, "this is not json\n")
                open(path, "w").writelines(lines)
            elif label == "a non-integer step":
                lines.insert(2, json.dumps({"step": "two", "loss": 1.0}) + "\n")
                open(path, "w").writelines(lines)
            elif label == "a null checkpoint step":
                lines.insert(2, json.dumps({"event": "checkpoint", "step": None}) + "\n")
                open(path, "w").writelines(lines)
            else:
                os.remove(path)
                os.mkdir(path)
            return self.cli(["train", "--model", "tiny", "--steps", "6", "--resume", "--progress", "none",
                             "--eval-every", "0", "--out", folder])
        if kind == "dtype":
            shutil.copytree(self.finished_run(), folder)
            return self.cli(["train", "--model", "tiny", "--steps", "5", "--resume", "--param-dtype", "bfloat16",
                             "--progress", "none", "--eval-every", "0", "--out", folder])
        if kind == "plain":
            return self.cli([*TRAIN, "--out", folder], case.shell)
        if kind == "ckpt":
            return self.cli(["train", "--model", "tiny", "--steps", "4", "--ckpt-every", "2", "--progress", "none",
                             "--eval-every", "0", "--out", folder], case.shell)
        if kind == "tmpfs":
            os.makedirs(folder)
            mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder], capture_output=True,
                                   timeout=60)
            if mount.returncode:
                return None
            try:
                return self.cli(["train", "--model", "tiny", "--steps", "20", "--ckpt-every", "2", "--keep-last",
                                 "100", "--progress", "none", "--eval-every", "0", "--out", os.path.join(folder, "r")])
            finally:
                subprocess.run(["umount", "-l", folder], capture_output=True, timeout=60)
        raise ValueError(kind)


def _fill(text: str, work: Optional[str]) -> str:
    return text.replace("{work}", work) if work else text


def tree_digest(root: str, skip: Optional[str] = None) -> dict:
    """``{relative path: sha256}`` of every file under ``root`` (not following links), less ``skip``."""
    found = {}
    for folder, dirs, files in os.walk(root):
        if skip and os.path.abspath(folder).startswith(os.path.abspath(skip)):
            continue
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            if skip and os.path.abspath(path) == os.path.abspath(skip):
                continue
            try:
                if os.path.islink(path):
                    digest = "link:" + os.readlink(path)
                else:
                    with open(path, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
            except OSError as exc:
                digest = f"unreadable:{exc.errno}"
            found[os.path.relpath(path, root)] = digest
    return found


def processes_marked(marker: str) -> List[int]:
    """Pids of live processes whose environment carries ``MESHTRAIN_PROBE_CASE=marker``."""
    want, pids = f"MESHTRAIN_PROBE_CASE={marker}".encode(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as st:
                        if st.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(pid))
        except OSError:
            continue
    return pids


def shm_entries() -> set:
    return set(glob.glob("/dev/shm/meshtrain-*"))


def judged(probe: Probe, case: Case) -> dict:
    """Runs ``case`` in a fresh folder and judges it, also on what it left behind."""
    if case.needs_root and os.geteuid() != 0:
        return judge(case, None)
    work = os.path.join(probe.tmp, "c-" + hashlib.sha1(case.name.encode()).hexdigest()[:12])
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if case.prepare is not None:
        case.prepare(work)
    out = os.path.abspath(_fill(case.out, work)) if case.out else None
    out_before = tree_digest(out) if out and os.path.isdir(out) else (
        tree_digest(os.path.dirname(out)).get(os.path.basename(out)) if out and os.path.exists(out) else None)
    before, shm_before = tree_digest(work, skip=out), shm_entries()
    got = probe.run(case, work)
    result = judge(case, got)
    if got is None:
        return result
    problems = []
    deadline = time.monotonic() + 10        # children of a killed supervisor get 10 s to notice and leave
    while (alive := processes_marked(probe.marker(case))) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive:
        problems.append(f"{len(alive)} process(es) left alive")
        for pid in alive:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    new_shm = shm_entries() - shm_before
    if new_shm:
        problems.append(f"left {sorted(new_shm)}")
        for path in new_shm:
            shutil.rmtree(path, ignore_errors=True)
    after = tree_digest(work, skip=out)
    changed = sorted(p for p in before if after.get(p) != before[p])
    if changed:
        problems.append(f"changed or removed {changed[:3]}")
    if out and result["code"] != 0:
        now = tree_digest(out) if os.path.isdir(out) else (
            tree_digest(os.path.dirname(out)).get(os.path.basename(out)) if os.path.exists(out) else None)
        if now != out_before:
            problems.append(f"left {os.path.relpath(out, work)} " + ("changed" if out_before else "behind"))
    if case.says and case.says not in got[1] + got[2]:
        problems.append(f"did not say {case.says!r}")
    if problems:
        result.update(ok=False, status="FAIL", said=(result["said"] + " [" + "; ".join(problems) + "]")[:400])
    return result


def judge(case: Case, got) -> dict:
    if got is None:
        return {"status": "skipped", "ok": True, "code": None, "traceback": False, "said": "(not root: no tmpfs)"}
    code, out, err, secs = got
    text = out + err
    traceback = "Traceback (most recent call last)" in text
    lines = [l for l in err.splitlines() if l.startswith(("error:", "warning:"))] or \
            [l for l in text.splitlines() if "PRECISION CHANGED" in l or "natural order" in l] or \
            [l for l in err.splitlines() if l.strip()][-1:] or [""]
    if case.expect == "warn":
        ok = code == 0 and any(l.startswith("warning:") for l in err.splitlines())
    elif case.interrupt_when:
        ok = code == 130
    else:
        ok = code == int(case.expect)
    if case.setup == "dtype":
        ok = ok and "PRECISION CHANGED" in text
    ok = ok and not traceback
    return {"status": "ok" if ok else "FAIL", "ok": ok, "code": code, "traceback": traceback,
            "said": lines[0][:220], "seconds": round(secs, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    p.add_argument("--group", default=None, choices=["cli", *GROUPS],
                   help="run one group's cases (default: every group)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case before it is killed")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--share-process", action="store_true",
                   help="run the cases that are only CLI arguments one after the other in one child process "
                        "(tools/probe_worker.py: meshtrain.cli.main with each case's own stdout, stderr, folder "
                        "and status) instead of a fresh interpreter each; the others still get their own")
    args = p.parse_args(argv)
    # Started from a non-interactive shell (`nohup … &`, a CI runner), this process may have inherited
    # an ignored SIGINT, which its children would inherit too and the Ctrl-C cases would test nothing.
    # A Python handler here becomes the default in every child (exec resets handlers, not SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tmp = tempfile.mkdtemp(prefix="meshtrain-probe-")
    try:
        probe = Probe(tmp, args.timeout, share_process=args.share_process)
        selected = [c for c in all_cases(tmp, args.group) if args.only in c.name]
        print("| case | expected | exit | traceback | first line | |\n|---|---|---|---|---|---|", flush=True)
        for case in selected:
            case.result = judged(probe, case)
            r = case.result
            said = r["said"].replace("|", "\\|")
            print(f"| {case.name} | {case.expect} | {r['code']} | {'yes' if r['traceback'] else 'no'} | `{said}` | "
                  f"{r['status']} |", flush=True)
        if probe.worker is not None:
            probe.worker.close()
        failed = [c.name for c in selected if not c.result["ok"]]
        tracebacks = sum(c.result["traceback"] for c in selected)
        print(f"\n{len(selected) - len(failed)} passed, {len(failed)} failed; {tracebacks} tracebacks"
              + (f"; failed: {failed}" if failed else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{"case": c.name, "group": c.group, "expect": c.expect, **c.result} for c in selected], f,
                          indent=1)
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
