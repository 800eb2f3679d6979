"""Generation speed as ``meshtrain generate`` reports it: prefill and decode tokens per second, with
the time JAX spent tracing, lowering and compiling the two steps taken out (a first call compiles;
those seconds are reported apart, as ``compile_s``).

The compile seconds come from JAX's monitoring events (``/jax/core/compile/*``), which name the
jitted function: those of a function whose name holds ``prefill`` count against the prefill, those
holding ``decode`` against the decoding; helpers count against neither, so the caller compiles those
that run inside the timed steps beforehand (``meshtrain generate`` makes the sampling key of step 0
first: JAX's key functions compile on first use). Example::

    with compile_seconds() as compiled:
        out = loaded.generate(prompts, 32)
    speed = Speed.of(out.timing, prompt_tokens=sum(map(len, ids)), new_tokens=..., compiled=compiled)
    print(speed.line())
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, Optional

#: the monitoring events of one compilation: tracing to a jaxpr, lowering to MLIR, XLA's compile
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
PHASES = ("prefill", "decode")


@contextlib.contextmanager
def compile_seconds() -> Iterator[Dict[str, float]]:
    """A dict that collects, while the block runs, the compile seconds of each phase (``prefill``,
    ``decode``) in this process."""
    import jax.monitoring

    seconds = {phase: 0.0 for phase in PHASES}

    def on_event(event, duration, fun_name="", **_):
        if event in COMPILE_EVENTS:
            for phase in PHASES:
                if phase in str(fun_name):
                    seconds[phase] += float(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


@dataclasses.dataclass(frozen=True)
class Speed:
    """One generation's figures: ``prompt_tokens`` (the prompts' real tokens, padding not counted)
    prefilled in ``prefill_s`` seconds, ``decode_tokens`` (new tokens after the first of each row,
    which the prefill chose) in ``decode_s`` seconds, both without ``compile_s`` (their compilation)."""

    prompt_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    compile_s: float

    @classmethod
    def of(cls, timing, prompt_tokens: int, new_tokens: int, rows: int,
           compiled: Optional[Dict[str, float]] = None) -> "Speed":
        """From an engine :class:`~meshtrain.generation.engine.Timing` of ``rows`` prompts that produced
        ``new_tokens`` in all, and :func:`compile_seconds`' dict collected around it."""
        compiled = compiled or {}
        pre, dec = compiled.get("prefill", 0.0), compiled.get("decode", 0.0)
        decode_wall = float(sum(timing.decode_s))
        return cls(prompt_tokens, max(timing.prefill_s - pre, 0.0), max(new_tokens - rows, 0),
                   max(decode_wall - dec, 0.0), pre + dec)

    @property
    def prefill_tokens_per_s(self) -> Optional[float]:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None

    def to_dict(self) -> Dict:
        return {**dataclasses.asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}

    def line(self) -> str:
        """``speed: prefill 12 tokens in 0.031 s (387 tokens/s); decode 60 tokens in 0.52 s (115 tokens/s);
        compiling 3.2 s (not counted)``"""
        def rate(x):
            return "-" if x is None else f"{x:,.1f}"

        return (f"speed: prefill {self.prompt_tokens} tokens in {self.prefill_s:.3f} s "
                f"({rate(self.prefill_tokens_per_s)} tokens/s); decode {self.decode_tokens} tokens in "
                f"{self.decode_s:.3f} s ({rate(self.decode_tokens_per_s)} tokens/s); compiling "
                f"{self.compile_s:.1f} s (not counted)")
