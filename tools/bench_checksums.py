"""Checksum throughput on this host: the candidates for checkpoint manifests, in memory, one thread.

    python tools/bench_checksums.py [--mb 256]

Measures SHA-256 and BLAKE2b (hashlib), CRC-32 (zlib) and, where installed, XXH3 (``xxhash``, a meshtrain
dependency), CRC32C (``google-crc32c``, ``crc32c``) and BLAKE3 (``blake3``); the best of 3 runs each, in
MB/s. Missing packages are listed, not installed. Figures: NOTES-wt-offload.md / BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import time
import zlib


def candidates():
    """``{name: function(bytes-like) -> digest}`` for the libraries importable here, and the missing ones."""
    out = {"sha256 (hashlib)": lambda b: hashlib.sha256(b).hexdigest(),
           "blake2b (hashlib)": lambda b: hashlib.blake2b(b).hexdigest(),
           "crc32 (zlib)": zlib.crc32}
    optional = {
        "xxh3_128 (xxhash)": ("xxhash", lambda m: lambda b: m.xxh3_128(b).hexdigest()),
        "xxh3_64 (xxhash)": ("xxhash", lambda m: lambda b: m.xxh3_64(b).hexdigest()),
        "crc32c (google-crc32c)": ("google_crc32c", lambda m: m.value),
        "crc32c (crc32c)": ("crc32c", lambda m: m.crc32c),
        "blake3 (blake3)": ("blake3", lambda m: lambda b: m.blake3(b).hexdigest()),
    }
    missing = []
    for name, (module, make) in optional.items():
        try:
            out[name] = make(importlib.import_module(module))
        except ImportError:
            missing.append(module)
    return out, sorted(set(missing))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="MiB of random bytes to hash")
    args = ap.parse_args(argv)
    data = memoryview(os.urandom(args.mb << 20))
    funcs, missing = candidates()
    results = {}
    for name, fn in funcs.items():
        best = min(_time(fn, data) for _ in range(3))
        results[name] = len(data) / best / 1e6
    for name, rate in sorted(results.items(), key=lambda kv: -kv[1]):
        print(f"{name:26s} {rate:9,.0f} MB/s")
    if missing:
        print("not installed: " + ", ".join(missing))
    return results


def _time(fn, data) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
