"""``meshtrain serve RUN``: an OpenAI-compatible HTTP server for a run's model (or a HuggingFace folder's).

The model is restored onto the generation recipe's plan exactly as ``meshtrain generate`` does
(``--recipe``, ``--mesh``, ``--quantize``, ``--devices``: multi-device as generation), then a
slotted KV cache of ``--max-batch`` rows × ``--context`` tokens is laid out on the same plan
(:mod:`meshtrain.serving.slots`), the prefill of the shortest prompts and the decode step are
compiled (so the first request does not pay for it), and Uvicorn serves the Starlette app
(:mod:`meshtrain.serving.app`) on ``--host`` (127.0.0.1 unless given) and ``--port``. One line on
stdout says where: ``serving NAME (...) at http://HOST:PORT``.

SIGTERM (or Ctrl-C) drains: the server stops taking connections, finishes the requests in flight,
then exits 0. The settings are the ``serve:`` section of the run configuration (``--config``,
``--set serve.max_batch=16``), the recipe and weight format the ``generation:`` section's.

Example::

    meshtrain serve runs/smollm --port 8000 --max-batch 16 --recipe dp --devices 1
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys

from meshtrain.commands.common import add_device_args
from meshtrain.commands.run_flags import add_run_flags, preparer, resolved_of
from meshtrain.errors import ConfigError
from meshtrain.settings import settings_of
from meshtrain.train.run_config import ServeSection

#: The run configuration's settings `meshtrain serve` reads: its own, and how generation holds the model.
SERVE_KEYS = tuple(f"serve.{s.name}" for s in settings_of(ServeSection)) + (
    "generation.recipe", "generation.mesh", "generation.quantize", "distributed.devices",
    "recipe.options.replicate_indivisible", "recipe.options.indivisible_heads")


def add_parser(sub):
    p = sub.add_parser("serve", help="serve a run's model over HTTP (OpenAI-compatible, continuous batching)",
                       description="Serve a run's model (or a HuggingFace folder's) with OpenAI's /v1/completions "
                                   "and /v1/chat/completions (streamed or whole), /v1/models and /health. Requests "
                                   "join and leave the running batch between decode steps.")
    p.add_argument("run_dir", metavar="RUN", help="run folder (or its checkpoints/ folder), or a HuggingFace model "
                   "folder, as for `meshtrain generate`")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    add_run_flags(p, SERVE_KEYS)
    add_device_args(p)
    p.set_defaults(run=run, prepare=preparer(SERVE_KEYS))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; a ConfigError naming the flag when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: not an address of this machine ({exc.strerror}); give e.g. 127.0.0.1 "
                          f"or 0.0.0.0") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(f"--port {port} on {host}: {why}; give another port (--port 0: any free one)") from None
    sock.listen(2048)
    return sock


def run(args) -> int:
    from meshtrain.serving.build import build_server  # lazy: the generation stack and the web framework

    cfg = resolved_of(args, SERVE_KEYS).config
    if cfg.serve.request_timeout <= 0:
        raise ConfigError(f"--request-timeout {cfg.serve.request_timeout}: give a number of seconds > 0")
    sock = bind(cfg.serve.host, cfg.serve.port)  # before loading: a taken port is refused at once
    built = build_server(args.run_dir, args.step, cfg, args.devices)
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(f"serving {built.model.name!r} ({built.description}) at http://{host}:{port}", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    config = uvicorn.Config(built.app, log_level="info", lifespan="on",
                            timeout_graceful_shutdown=int(cfg.serve.request_timeout) + 5)
    # Uvicorn drains on SIGTERM / SIGINT, then raises the signal again under the handler it found: this
    # one, which ignores it, so the command returns 0 once drained
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])
    print("served; drained and stopped", flush=True)
    return 0
