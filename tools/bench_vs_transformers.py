"""meshtrain's generation against transformers' Flax ``generate`` on the same model, prompt ids and
token count, alternated in one process (``tools/bench_generate.py RUN --vs-transformers``).

The run is exported to a float32 HuggingFace folder (``meshtrain export``'s code) and loaded into
transformers' Flax class of its architecture (llama, mistral, gemma: the ones transformers' Flax has).
Both generate greedily with no end token, so each makes exactly ``new_tokens`` tokens per row; each
is compiled before the timed rounds (transformers' ``generate`` under ``jax.jit``, its fastest use).

Figures per round:

* **end-to-end tokens/s**: rows × new tokens ÷ the wall seconds of one whole call (prompt in, tokens
  on the host): the like-for-like figure;
* **decode tokens/s**: meshtrain's from its step timings (:class:`meshtrain.generation.speed.Speed`);
  transformers' as rows × (new tokens − 1) ÷ (its call for ``new_tokens`` − its call for 1 token),
  i.e. its generate minus its prefill;
* **prefill tokens/s**: meshtrain's from its timings; transformers' from its 1-token call.

The load average (1, 5, 15 min) is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

#: model_type (config.json) -> transformers' Flax causal-LM class
FLAX_CLASSES = {"llama": "FlaxLlamaForCausalLM", "mistral": "FlaxMistralForCausalLM", "gemma": "FlaxGemmaForCausalLM"}


def flax_model(run: str, folder: str, devices):
    """transformers' Flax model of ``run`` (exported to ``folder`` in float32), greedy with no end token."""
    import jax.numpy as jnp
    import transformers

    from meshtrain.errors import ConfigError
    from meshtrain.train.interop import export_hf

    export_hf(run, folder, dtype="float32", devices=devices)
    with open(os.path.join(folder, "config.json")) as f:
        kind = json.load(f)["model_type"]
    if kind not in FLAX_CLASSES:
        raise ConfigError(f"--vs-transformers: run {run!r} is a {kind} model, which transformers has no Flax class "
                          f"for (it has {', '.join(sorted(FLAX_CLASSES))})")
    model = getattr(transformers, FLAX_CLASSES[kind]).from_pretrained(folder, from_pt=True, dtype=jnp.float32)
    # no end token (an id no row can emit): exactly new_tokens tokens, as meshtrain with no stop ids
    model.generation_config.eos_token_id = model.config.vocab_size
    model.generation_config.pad_token_id = 0
    return model


def transformers_generate(model, new_tokens):
    """A compiled ``ids_bt -> sequences_bt`` of transformers' greedy generate for ``new_tokens`` tokens."""
    import jax

    def run(params, ids_bt):
        return model.generate(ids_bt, params=params, max_new_tokens=new_tokens, do_sample=False).sequences

    return jax.jit(run)


def timed(call):
    """``(seconds, result)`` of ``call()``, the result on the host."""
    import numpy as np

    start = time.perf_counter()
    out = call()
    out = np.asarray(out)
    return time.perf_counter() - start, out


def measure_meshtrain(loaded, prompts, new_tokens, repeats):
    from meshtrain.generation.speed import Speed

    wall, out = None, None
    for _ in range(repeats):  # the fastest of `repeats` calls
        start = time.perf_counter()
        this = loaded.generate(prompts, new_tokens)
        seconds = time.perf_counter() - start
        if wall is None or seconds < wall:
            wall, out = seconds, this
    gens = out.generations
    speed = Speed.of(out.timing, sum(map(len, prompts)), sum(len(g.new_ids) for g in gens), len(gens))
    return {"end_to_end_tokens_per_s": len(prompts) * new_tokens / wall, "wall_s": wall,
            "prefill_tokens_per_s": speed.prefill_tokens_per_s, "decode_tokens_per_s": speed.decode_tokens_per_s,
            "new_ids": [list(g.new_ids) for g in gens]}


def measure_transformers(model, full, first, ids_bt, new_tokens, repeats):
    rows, length = ids_bt.shape
    one_s = min(timed(lambda: first(model.params, ids_bt))[0] for _ in range(repeats))
    wall, seq_bt = min((timed(lambda: full(model.params, ids_bt)) for _ in range(repeats)), key=lambda x: x[0])
    decode_s = wall - one_s
    return {"end_to_end_tokens_per_s": rows * new_tokens / wall, "wall_s": wall,
            "prefill_tokens_per_s": rows * length / one_s,
            "decode_tokens_per_s": rows * (new_tokens - 1) / decode_s if decode_s > 0 else None,
            "new_ids": seq_bt[:, length:].tolist()}


def compare_run(run, recipe, batch, prompt_len, new_tokens, rounds, devices, repeats=3, as_json=False):
    """Alternate ``rounds`` of meshtrain and transformers (each the fastest of ``repeats`` calls); print
    the table (or one JSON object) and return it."""
    import jax
    import numpy as np
    from bench_generate import bench_prompts

    from meshtrain.generation import load

    load_before = os.getloadavg()
    loaded = load(run, recipe=recipe, devices=devices)
    prompts = bench_prompts(loaded.engine.cfg.vocab_size, batch, prompt_len)
    ids_bt = jax.numpy.asarray(np.asarray(prompts, np.int32))
    with tempfile.TemporaryDirectory() as folder:
        model = flax_model(run, os.path.join(folder, "hf"), devices)
    full, first = transformers_generate(model, new_tokens), transformers_generate(model, 1)
    loaded.generate(prompts, new_tokens)  # compile both sides before timing
    timed(lambda: full(model.params, ids_bt))
    timed(lambda: first(model.params, ids_bt))
    results = []
    for r in range(rounds):
        results.append({"round": r, "meshtrain": measure_meshtrain(loaded, prompts, new_tokens, repeats),
                        "transformers": measure_transformers(model, full, first, ids_bt, new_tokens, repeats)})
    report = summary(run, recipe, batch, prompt_len, new_tokens, results, load_before, os.getloadavg())
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        print_report(report)
    return report


def _median(values):
    """The median of the figures measured (``None``: a round whose decode time came out <= 0, the whole
    generation no slower than its first token on a busy host), or ``None`` when no round measured one."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(medians, figure):
    ours, theirs = medians["meshtrain"][figure], medians["transformers"][figure]
    return ours / theirs if ours is not None and theirs else None


def summary(run, recipe, batch, prompt_len, new_tokens, results, load_before, load_after):
    figures = ("end_to_end_tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s")
    medians = {side: {f: _median(x[side][f] for x in results) for f in figures} for side in ("meshtrain", "transformers")}
    ours, theirs = results[-1]["meshtrain"]["new_ids"], results[-1]["transformers"]["new_ids"]
    first_diff = next((i for row_a, row_b in zip(ours, theirs) for i, (a, b) in enumerate(zip(row_a, row_b))
                       if a != b), None)
    rows = [{"round": x["round"], **{f"{side}_{f}": x[side][f] for side in ("meshtrain", "transformers")
                                     for f in figures}} for x in results]
    return {"run": run, "recipe": recipe, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "rounds": rows, "median": medians,
            "ratio_end_to_end": _ratio(medians, "end_to_end_tokens_per_s"),
            "ratio_decode": _ratio(medians, "decode_tokens_per_s"),
            "same_tokens": first_diff is None, "first_difference": first_diff,
            "load_average_before": list(load_before), "load_average_after": list(load_after)}


def print_report(report):
    def f(x):
        return "-" if x is None else f"{x:,.1f}"

    print(f"{report['run']}: recipe {report['recipe']}, batch {report['batch']}, prompt {report['prompt_len']} "
          f"tokens, {report['new_tokens']} new tokens; tokens/s (end-to-end | decode | prefill)")
    print(f"{'round':>5}  {'meshtrain e2e':>13} {'decode':>9} {'prefill':>9}   {'transformers e2e':>16} "
          f"{'decode':>9} {'prefill':>9}")
    for r in report["rounds"]:
        print(f"{r['round']:>5}  {f(r['meshtrain_end_to_end_tokens_per_s']):>13} "
              f"{f(r['meshtrain_decode_tokens_per_s']):>9} {f(r['meshtrain_prefill_tokens_per_s']):>9}   "
              f"{f(r['transformers_end_to_end_tokens_per_s']):>16} {f(r['transformers_decode_tokens_per_s']):>9} "
              f"{f(r['transformers_prefill_tokens_per_s']):>9}")
    m, t = report["median"]["meshtrain"], report["median"]["transformers"]
    print(f"{'median':>6} {f(m['end_to_end_tokens_per_s']):>13} {f(m['decode_tokens_per_s']):>9} "
          f"{f(m['prefill_tokens_per_s']):>9}   {f(t['end_to_end_tokens_per_s']):>16} {f(t['decode_tokens_per_s']):>9} "
          f"{f(t['prefill_tokens_per_s']):>9}")
    x = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731  (None: a side without a decode time)
    print(f"meshtrain / transformers: end-to-end {x(report['ratio_end_to_end'])}, decode "
          f"{x(report['ratio_decode'])}; same greedy tokens: "
          f"{'yes' if report['same_tokens'] else 'no, first difference at %d' % report['first_difference']}")
    print("load average (1, 5, 15 min): before " + ", ".join(f"{x:.2f}" for x in report["load_average_before"])
          + "; after " + ", ".join(f"{x:.2f}" for x in report["load_average_after"]), flush=True)
