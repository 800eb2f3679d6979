"""``meshtrain ckpt list DIR`` and ``meshtrain ckpt inspect DIR [--step N]``.

DIR is a run folder or its ``checkpoints/`` subfolder. ``list`` shows every step with its integrity
(full SHA-256 check unless ``--quick``); ``inspect`` shows one step: tree, shapes, dtypes, saved
shardings, sizes, recipe, data position and integrity. Both take ``--json``. Exit status: 0, or 1
when the inspected step fails its integrity check; bad input prints ``error: ...`` and exits 2.
"""

from __future__ import annotations

import datetime
import json

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.inspection import inspect_checkpoint, read_meta, resolve_directory
from meshtrain.checkpoint.manager import fmt_bytes
from meshtrain.checkpoint.types import CheckpointError, Verify


def add_parser(sub):
    p = sub.add_parser("ckpt", help="list and inspect checkpoints (integrity, tree, shardings, recipe)")
    actions = p.add_subparsers(dest="ckpt_action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("list", help="every step of a checkpoint folder with its integrity status")
    ls.add_argument("dir", metavar="DIR", help="run folder or its checkpoints/ subfolder")
    ls.add_argument("--quick", action="store_true", help="check file presence and sizes only (no checksums)")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(run=run_list, setup_devices=False)
    ins = actions.add_parser("inspect", help="tree, shapes, dtypes, saved shardings, sizes, recipe of one step")
    ins.add_argument("dir", metavar="DIR", help="run folder or its checkpoints/ subfolder")
    ins.add_argument("--step", type=int, default=None, help="step to inspect (default: the latest valid step)")
    ins.add_argument("--max-rows", type=int, default=None, help="show at most this many tree rows")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.set_defaults(run=run_inspect, setup_devices=False)
    p.set_defaults(setup_devices=False)


def _fmt_bytes(n) -> str:
    return fmt_bytes(n or 0)


def _when(unix) -> str:
    if not unix:
        return "-"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def run_list(args) -> int:
    d = resolve_directory(args.dir)
    verify = Verify.QUICK if args.quick else Verify.FULL
    rows = []
    for step, path in integrity.step_dirs(d).items():
        check = integrity.check_step(path, step, verify)
        try:
            meta = read_meta(path)
            recipe = (meta.get("user") or {}).get("recipe")
            saved = meta.get("saved_unix")
        except CheckpointError:
            recipe, saved = None, None
        rows.append({**check.to_dict(), "saved_unix": saved,
                     "recipe": recipe.get("name") if isinstance(recipe, dict) else recipe})
    latest = next((r["step"] for r in reversed(rows) if r["status"] == "ok"), None)
    temporary = [p.name for p in integrity.tmp_dirs(d)]
    set_aside = [p.name for p in integrity.aside_dirs(d)]
    if args.json:
        print(json.dumps({"directory": str(d), "steps": rows, "latest_valid_step": latest,
                          "temporary": temporary, "set_aside": set_aside, "verify": verify.value}))
        return 0
    print(f"checkpoints in {d} ({'sizes only' if args.quick else 'full checksum check'})")
    if rows:
        print(_table(("step", "status", "size", "files", "saved", "recipe", "reason"),
                     [(r["step"], r["status"], _fmt_bytes(r["bytes"]), r["files"], _when(r["saved_unix"]),
                       r["recipe"] or "-", r["reason"]) for r in rows]))
    else:
        print("no committed steps")
    if temporary:
        print("temporary (uncommitted) folders: " + ", ".join(temporary))
    if set_aside:
        print("damaged steps set aside (kept, never restored): " + ", ".join(set_aside))
    print(f"latest valid step: {latest if latest is not None else 'none'}")
    return 0


def _sharding(s) -> str:
    if isinstance(s, dict):
        spec = s.get("spec") or []
        mesh = ",".join(f"{k}={v}" for k, v in (s.get("mesh") or {}).items())
        return f"P({', '.join(repr(e) if not isinstance(e, list) else str(tuple(e)) for e in spec)}) on {mesh}"
    return str(s) if s is not None else "-"


def run_inspect(args) -> int:
    info = inspect_checkpoint(args.dir, args.step)
    ok = info["integrity"]["status"] == "ok"
    if args.json:
        print(json.dumps(info))
        return 0 if ok else 1
    i = info["integrity"]
    print(f"checkpoint {info['directory']} step {info['step']}: {i['status']}"
          + (f" ({i['reason']})" if i["reason"] else "")
          + f"  [{i['verify']} check, {i['files']} files, {_fmt_bytes(i['bytes'])}]")
    others = [f"{s['step']} {s['status']}" for s in info["steps"] if s["step"] != info["step"]]
    if others:
        print("other steps: " + ", ".join(others))
    if info["temporary"]:
        print("temporary (uncommitted) folders: " + ", ".join(info["temporary"]))
    if "tree" not in info:
        print(f"metadata unavailable: {info.get('error')}")
        return 1
    recipe = info.get("recipe")
    if isinstance(recipe, dict):
        recipe_text = f"{recipe.get('name')} (strategies {', '.join(recipe.get('strategies', []))})"
    else:
        recipe_text = str(recipe) if recipe is not None else "-"
    mesh = ",".join(f"{k}={v}" for k, v in (info.get("mesh") or {}).items()) or "-"
    versions = info.get("versions") or {}
    print(f"saved {_when(info.get('saved_unix'))} by {info.get('process_count')} process(es) on "
          f"{info.get('device_count')} devices; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"model {info.get('model') or '-'}  recipe {recipe_text}  saved on mesh {mesh}  seed {info.get('seed')}  "
          f"compression {info.get('compression') or '-'}")
    print(f"data state {json.dumps(info.get('data_state'))}")
    print("items on disk: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in info["items"].items())
          + f"; state {_fmt_bytes(info['state_bytes'])} in memory")
    tree = info["tree"][:args.max_rows] if args.max_rows else info["tree"]
    print(_table(("path", "shape", "dtype", "saved sharding", "bytes"),
                 [(e["path"], "×".join(map(str, e["shape"])) or "()", e["dtype"], _sharding(e.get("sharding")),
                   _fmt_bytes(e.get("bytes"))) for e in tree]))
    if len(tree) < len(info["tree"]):
        print(f"... {len(info['tree']) - len(tree)} more rows (--max-rows)")
    return 0 if ok else 1
