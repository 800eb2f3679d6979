"""``meshtrain serve`` under load: N concurrent clients against one server, and the same requests one
after another.

    python tools/bench_serve.py RUN --recipe dp --devices 1             # N = 1, 4, 16, 64
    python tools/bench_serve.py --clients 1 16 --requests-per-client 4 --max-tokens 64
    python tools/bench_serve.py --json
    python tools/bench_serve.py --no-http                              # the scheduler alone, in this process

Without RUN, a ``tiny`` run is trained for one step into a temporary folder (the weights do not change
the speed). Each client sends ``--requests-per-client`` completions one after another: a
``--prompt-len``-token prompt of its own (token ids), ``--max-tokens`` new tokens, greedy, no stop at
the end-of-sequence ids (``ignore_eos``), so every request makes exactly ``--max-tokens`` tokens.

Two servers, each started (and warmed up by one request) before its clock starts:

* ``--max-batch`` slots (default 64): the rows N = ``--clients``;
* 1 slot: the N = 16 requests (or the largest N below it) sent by one client one after another, the
  baseline of serving without batching.

Figures per row: throughput = completion tokens of all requests ÷ the wall seconds from the first
request sent to the last answer; latency = each request's seconds from sent to answered (p50, p99 over
the row's requests). The last line: N = 16's throughput over the one-after-another row's (the issue's
bar: >= 4x), and the load average before and after.

``--no-http`` measures the same rows against the scheduler itself (:mod:`meshtrain.serving.scheduler`,
built as ``meshtrain serve`` builds it, in this process): continuous batching without the HTTP layer,
the requests submitted from threads of this process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_BOUND_S = 900


class Server:
    """A ``meshtrain serve`` child on a free port."""

    def __init__(self, run: str, extra: List[str], max_batch: int, log_dir: str):
        self.log = open(os.path.join(log_dir, f"serve-{max_batch}.log"), "w")
        out_path = os.path.join(log_dir, f"serve-{max_batch}.out")
        with open(out_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "serve", run, "--port", "0",
                                          "--max-batch", str(max_batch), "--max-queue", "4096", *extra],
                                         stdout=out, stderr=self.log, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + START_BOUND_S
        while time.monotonic() < deadline:
            line = next((w for w in open(out_path).read().splitlines() if w.startswith("serving ")), None)
            if line:
                self.description = line
                self.host, port = line.rsplit("http://", 1)[1].rsplit(":", 1)
                self.port = int(port)
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited {self.proc.returncode}; see {self.log.name}")
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not start within {START_BOUND_S} s; see {self.log.name}")

    def complete(self, body: Dict) -> Dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=START_BOUND_S)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        if response.status != 200:
            raise SystemExit(f"request refused ({response.status}): {answer}")
        return answer

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def request_body(i: int, args) -> Dict:
    prompt = [(7 * i + 3 * t) % 200 + 1 for t in range(args.prompt_len)]  # distinct per request
    return {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}


def measure(server: Server, clients: int, per_client: int, args) -> Dict:
    """``clients`` threads, each sending ``per_client`` requests one after another."""

    def client(c: int) -> List[float]:
        out = []
        for r in range(per_client):
            start = time.perf_counter()
            answer = server.complete(request_body(c * per_client + r, args))
            assert answer["usage"]["completion_tokens"] == args.max_tokens, answer["usage"]
            out.append(time.perf_counter() - start)
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = [x for row in pool.map(client, range(clients)) for x in row]
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": len(latencies), "wall_s": round(wall, 3),
            "tokens_per_s": round(len(latencies) * args.max_tokens / wall, 1),
            "p50_s": round(float(np.percentile(latencies, 50)), 3), "p99_s": round(float(np.percentile(latencies, 99)), 3)}


class InProcess:
    """The scheduler ``meshtrain serve`` would run, without HTTP: ``complete`` submits and waits."""

    def __init__(self, run: str, args, max_batch: int):
        from meshtrain.serving.build import build_server
        from meshtrain.train.run_config import RunConfig

        cfg = RunConfig().with_values({"serve.max_batch": max_batch, "serve.max_queue": 4096,
                                       "generation.recipe": args.recipe, "serve.context": args.context or None})
        self.built = build_server(run, None, cfg, args.devices)
        self.built.scheduler.start()

    def complete(self, body: Dict) -> Dict:
        import threading

        from meshtrain.serving.protocol import Kind, parse

        request = parse(Kind.COMPLETION, {**body, "model": self.built.model.name}, self.built.model)
        done, box = threading.Event(), []
        self.built.scheduler.submit(request.job, lambda e: (box.append(e), done.set()), whole=True)
        done.wait(START_BOUND_S)
        return {"usage": {"completion_tokens": box[0].completion_tokens}}

    def stop(self) -> None:
        self.built.scheduler.close()
        self.built.scheduler.join(60)


def tiny_run(folder: str, model: str = "tiny") -> str:
    run = os.path.join(folder, model)
    subprocess.run([sys.executable, "-m", "meshtrain", "train", "--model", model, "--steps", "1", "--ckpt-every", "1",
                    "--out", run, "--devices", "1", "--recipe", "dp", "--progress", "none"], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, timeout=START_BOUND_S)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", help="run folder (default: a tiny run trained for one step)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--model", default="tiny", help="the built-in model trained for one step when no RUN is given")
    p.add_argument("--context", type=int, default=0, help="tokens per slot (0: the model's max_seq_len)")
    p.add_argument("--recipe", default="dp")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--no-http", action="store_true", help="the scheduler alone, in this process")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.no_http:
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    load_before = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="bench_serve_")
    run = args.run or tiny_run(folder, args.model)
    extra = ["--recipe", args.recipe, "--devices", str(args.devices), "--model-name", "bench"]
    extra += ["--context", str(args.context)] if args.context else []
    rows = []
    for max_batch in (args.max_batch, 1):
        server = InProcess(run, args, max_batch) if args.no_http else Server(run, extra, max_batch, folder)
        try:
            server.complete(request_body(0, args))  # warm: every program compiled before the clock starts
            if max_batch == 1:
                n = max([c for c in args.clients if c <= 16] or [1])
                row = measure(server, 1, n * args.requests_per_client, args)
                rows.append({**row, "clients": f"{n} one after another", "slots": 1})
            else:
                rows += [{**measure(server, n, args.requests_per_client, args), "slots": max_batch}
                         for n in args.clients]
        finally:
            server.stop()
    load_after = os.getloadavg()
    batched = next((r for r in rows if r["clients"] == 16), None)
    ratio = batched["tokens_per_s"] / rows[-1]["tokens_per_s"] if batched else None
    if args.json:
        print(json.dumps({"rows": rows, "ratio_16": ratio, "load_before": load_before, "load_after": load_after}))
        return
    print(f"{'scheduler alone (no HTTP)' if args.no_http else 'HTTP'}; run {run} ({args.model if not args.run else 'given'}, context {args.context or 'max_seq_len'}); {args.prompt_len}-token prompts, {args.max_tokens} new tokens each, greedy, "
          f"{args.requests_per_client} requests per client; recipe {args.recipe} on {args.devices} device(s)")
    print("| clients | slots | requests | wall s | tokens/s | p50 latency s | p99 latency s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['slots']} | {r['requests']} | {r['wall_s']} | {r['tokens_per_s']} | "
              f"{r['p50_s']} | {r['p99_s']} |")
    if ratio is not None:
        print(f"N = 16 batched / one after another: {ratio:.1f}x throughput")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")


if __name__ == "__main__":
    main()
