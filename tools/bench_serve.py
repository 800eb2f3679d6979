"""``meshtrain serve`` under load: N concurrent clients against one server, and the same requests one
after another.

    python tools/bench_serve.py                                         # N = 1, 4, 16, 64; the default workload
    python tools/bench_serve.py RUN --recipe dp --devices 1             # a run folder of yours
    python tools/bench_serve.py --rounds 3                              # N = 16 vs one after another, 3 times
    python tools/bench_serve.py --model tiny --max-tokens 32 --json
    python tools/bench_serve.py --no-http                               # the scheduler alone, in this process

The default workload is what serving is: a model whose decode step is dominated by reading its weights
(``bench-25m``: a Llama of 24M parameters, 97 MB in f32, 3x this host's 32 MB L3 cache; 8 query heads
sharing 2 KV heads; trained for one step from a ``config.json`` this tool writes: the weights do not change
the speed), requests of ``--max-tokens`` 128 new tokens after a 16-token prompt. ``--model tiny`` or
``small`` (built-in) fit in the L3 cache with their weights, so a step over 1 row costs about as little as
the cache reads and the HTTP work: they measure the server's overheads, not batching.

Each client sends ``--requests-per-client`` completions one after another: a ``--prompt-len``-token prompt
of its own (token ids), ``--max-tokens`` new tokens, greedy, no stop at the end-of-sequence ids
(``ignore_eos``), so every request makes exactly ``--max-tokens`` tokens.

Two servers, both started (and warmed up by one request) before any clock starts:

* ``--max-batch`` slots (default 64): the rows N = ``--clients``, and the N = 16 requests (or the largest N
  below it) sent by one client one after another ("one after another, same server");
* 1 slot: the same one-after-another requests ("one after another, 1 slot": a server without batching).

With ``--rounds R`` the N = 16 row and both one-after-another rows are measured R times, alternated, so a
change in the host's load falls on both sides. Figures per row: throughput = completion tokens of all
requests / the wall seconds from the first request sent to the last answer; latency = each request's
seconds from sent to answered (p50, p99 over the row's requests). The last lines: N = 16's throughput over
each one-after-another row's (the issue's bar: >= 4x), and the load average before and after.

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
    return {"clients": clients, "requests": len(latencies), "wall_s": round(wall, 3), "load": round(os.getloadavg()[0], 1),
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


#: the default workload's model (a HuggingFace ``config.json``: ``meshtrain train --model FOLDER`` builds it)
BENCH_MODELS = {"bench-25m": {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 264, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}}


def train_run(folder: str, model: str) -> str:
    """A run of ``model`` (built-in or :data:`BENCH_MODELS`) trained for one step in ``folder``."""
    run = os.path.join(folder, model)
    source = model
    if model in BENCH_MODELS:
        source = os.path.join(folder, f"{model}-config")
        os.makedirs(source, exist_ok=True)
        with open(os.path.join(source, "config.json"), "w") as f:
            json.dump(BENCH_MODELS[model], f)
    subprocess.run([sys.executable, "-m", "meshtrain", "train", "--model", source, "--steps", "1", "--ckpt-every", "1",
                    "--warmup-steps", "1", "--out", run, "--devices", "1", "--recipe", "dp", "--progress", "none"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=START_BOUND_S)
    return run


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", help="run folder (default: --model trained for one step)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="N = 16 and one after another, alternated this many times")
    p.add_argument("--model", default="bench-25m", help=f"the model trained for one step when no RUN is given: "
                   f"{', '.join(BENCH_MODELS)} or a built-in name (tiny, small)")
    p.add_argument("--context", type=int, default=0, help="tokens per slot (0: the model's max_seq_len)")
    p.add_argument("--recipe", default="dp")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--no-http", action="store_true", help="the scheduler alone, in this process")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def run_rows(servers: Dict[int, object], args) -> List[Dict]:
    """Every N once, then ``--rounds`` of (N = 16, one after another on the same server, on 1 slot)."""
    big = servers[args.max_batch]
    n_seq = max([c for c in args.clients if c <= 16] or [1])
    rows = [{**measure(big, n, args.requests_per_client, args), "slots": args.max_batch, "round": 0}
            for n in args.clients]
    for r in range(1, args.rounds + 1):
        if r > 1 and n_seq in args.clients:
            rows.append({**measure(big, n_seq, args.requests_per_client, args), "slots": args.max_batch, "round": r})
        for slots in (args.max_batch, 1):
            row = measure(servers[slots], 1, n_seq * args.requests_per_client, args)
            rows.append({**row, "clients": f"{n_seq} one after another", "slots": slots, "round": r})
    return rows


def ratios(rows: List[Dict], args) -> Dict[str, float]:
    """N = 16's throughput over each one-after-another row's, from the medians over the rounds."""
    batched = [r["tokens_per_s"] for r in rows if r["clients"] == 16]
    if not batched:
        return {}
    out = {}
    for slots, name in ((args.max_batch, "same_server"), (1, "one_slot")):
        seq = [r["tokens_per_s"] for r in rows if isinstance(r["clients"], str) and r["slots"] == slots]
        out[name] = round(float(np.median(batched)) / float(np.median(seq)), 2)
    return out


def main() -> None:
    args = parse_args()
    if args.no_http:
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    folder = tempfile.mkdtemp(prefix="bench_serve_")
    run = args.run or train_run(folder, args.model)
    extra = ["--recipe", args.recipe, "--devices", str(args.devices), "--model-name", "bench"]
    extra += ["--context", str(args.context)] if args.context else []
    servers: Dict[int, object] = {}
    try:
        for max_batch in (args.max_batch, 1):
            servers[max_batch] = (InProcess(run, args, max_batch) if args.no_http
                                  else Server(run, extra, max_batch, folder))
            servers[max_batch].complete(request_body(0, args))  # warm: every program compiled before any clock
        load_before = os.getloadavg()
        rows = run_rows(servers, args)
        load_after = os.getloadavg()
    finally:
        for server in servers.values():
            server.stop()
    ratio = ratios(rows, args)
    if args.json:
        print(json.dumps({"rows": rows, "ratio_16": ratio, "load_before": load_before, "load_after": load_after}))
        return
    print(f"{'scheduler alone (no HTTP)' if args.no_http else 'HTTP'}; run {run} ({args.model if not args.run else 'given'}, "
          f"context {args.context or 'max_seq_len'}); {args.prompt_len}-token prompts, {args.max_tokens} new tokens "
          f"each, greedy, {args.requests_per_client} requests per client; recipe {args.recipe} on {args.devices} device(s)")
    print("| round | clients | slots | requests | wall s | tokens/s | p50 latency s | p99 latency s | load after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['clients']} | {r['slots']} | {r['requests']} | {r['wall_s']} | {r['tokens_per_s']} | "
              f"{r['p50_s']} | {r['p99_s']} | {r['load']} |")
    for name, value in ratio.items():
        print(f"N = 16 batched / one after another ({name.replace('_', ' ')}): {value:.2f}x throughput (medians)")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")


if __name__ == "__main__":
    main()
