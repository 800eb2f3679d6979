"""``meshtrain generate --chat / --system / --messages`` on an imported tiny Llama with a chat template:
the prompt ids are transformers' ``apply_chat_template`` ids, generation stops at the run's
end-of-sequence ids by default (tokenizer eos, ``generation_config.json``), the speed is printed and
carried by ``--json``, and ``--chat`` without a template is a one-line error."""

from __future__ import annotations

import json
import os
import re
import types

import pytest
from test_chat_template import CHATML, tokenizer_folder
from test_hf import hf_folder

import meshtrain as mt
from meshtrain.cli import main
from meshtrain.commands.generate import chat_prompts
from meshtrain.data.chat import ChatTemplate, ChatTemplateError
from meshtrain.errors import ConfigError
from meshtrain.generation.runs import read_run
from meshtrain.train.interop import import_hf

transformers = pytest.importorskip("transformers")

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """An imported tiny random Llama whose folder holds a chatml tokenizer (its vocabulary) and a
    generation_config.json; returns (run, transformers' tokenizer)."""
    d = tmp_path_factory.mktemp("chat")
    source = tokenizer_folder(d / "src", CHATML)
    vocab = transformers.AutoTokenizer.from_pretrained(source)
    hf_folder(d / "src", "llama", vocab_size=len(vocab), max_position_embeddings=128)
    (d / "src" / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    (d / "src" / "generation_config.json").write_text(json.dumps({"eos_token_id": [len(vocab) - 1]}))
    import_hf(source, str(d / "run"))
    return str(d / "run"), vocab


def generate(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_chat_prompts_are_transformers_ids_and_stop_at_the_end_ids(chat_run, capsys, tmp_path):
    run, hf_tokenizer = chat_run
    expected = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    code, out, err = generate(capsys, run, "--chat", "--system", "Be brief.", "--prompt", "What is 2 + 2?",
                              "--max-new-tokens", 8, "--stop-ids", "none", "--json", "--recipe", "dp")
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    reference = mt.generate(run, [list(expected)], max_new_tokens=8, recipe="dp")[0]  # the same ids, by hand
    assert row["new_ids"] == list(reference.new_ids) and len(row["new_ids"]) == 8
    speed = row["speed"]  # figures, not bounds
    assert speed["prompt_tokens"] == len(expected) and speed["decode_tokens"] == 7
    assert speed["prefill_tokens_per_s"] > 0 and speed["decode_tokens_per_s"] > 0 and speed["compile_s"] > 0
    # --messages: the same conversation from a file gives the same tokens
    (tmp_path / "chat.json").write_text(json.dumps([CONVERSATION, CONVERSATION[1:]]))
    code, out, err = generate(capsys, run, "--messages", tmp_path / "chat.json", "--max-new-tokens", 8,
                              "--stop-ids", "none", "--json", "--recipe", "dp")
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0 and rows[0]["new_ids"] == row["new_ids"] and len(rows) == 2, err
    # generation_config.json names the 4th new token as an end id: generation stops there by default
    with open(os.path.join(run, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [row["new_ids"][3], 0]}, f)
    ends = read_run(run).end_ids
    assert row["new_ids"][3] in ends
    stop = next(i for i, t in enumerate(row["new_ids"]) if t in ends)  # <= 3 (the tokenizer's eos may come first)
    code, out, err = generate(capsys, run, "--chat", "--system", "Be brief.", "--prompt", "What is 2 + 2?",
                              "--max-new-tokens", 8, "--recipe", "dp")
    assert code == 0, err
    assert f"over {stop + 1} tokens" in out.splitlines()[0], out
    assert out.splitlines()[-1].startswith("speed: prefill ") and "compiling" in out.splitlines()[-1]


@pytest.mark.slow
def test_end_ids_and_chat_without_a_template(chat_run, capsys, tmp_path):
    run, hf_tokenizer = chat_run
    info = read_run(run)
    assert hf_tokenizer.convert_tokens_to_ids("<|im_end|>") in info.end_ids  # the tokenizer's eos
    assert info.chat_template().source == CHATML
    assert json.loads(open(os.path.join(run, "special_tokens_map.json")).read()) == {"bos_token": "<|begin_of_text|>"}
    assert os.path.isfile(os.path.join(run, "generation_config.json"))  # carried by the import
    plain = tmp_path / "plain"
    import_hf(hf_folder(tmp_path / "src", "llama")[0], str(plain))  # no tokenizer: --chat has no template
    code, out, err = generate(capsys, plain, "--chat", "--prompt", "hi", "--max-new-tokens", 2)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --chat: run {str(plain)!r} has no tokenizer; give the prompt in the model's format without --chat, "
        f"or import the model with its tokenizer_config.json"], err
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: the chat template does not compile"):
        import_hf(str(tmp_path / "src"), str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")


def test_chat_prompts_and_their_errors(tmp_path):
    """The prompt side of `generate --chat` without a model: rendering, --messages files, bad combinations."""
    info = types.SimpleNamespace(chat_template=lambda: ChatTemplate(CHATML), folder=tmp_path, tokenizer=None)
    args = dict(chat=True, messages=None, system="Be brief.", prompt_ids=None)
    rendered = chat_prompts(types.SimpleNamespace(**args), info, ["What is 2 + 2?"])
    assert rendered == [ChatTemplate(CHATML).render(CONVERSATION, add_generation_prompt=True)]
    (tmp_path / "one.json").write_text(json.dumps(CONVERSATION))
    assert chat_prompts(types.SimpleNamespace(**{**args, "system": None, "messages": str(tmp_path / "one.json")}),
                        info, []) == rendered
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "user"}]))
    for changes, message in (({"messages": str(tmp_path / "bad.json"), "system": None}, "message 0 of a conversation"),
                             ({"messages": str(tmp_path / "nothing.json"), "system": None}, "cannot read it as JSON"),
                             ({"messages": str(tmp_path / "one.json")}, "put the system turn in the file"),
                             ({"chat": False}, "--system TEXT adds a system turn"),
                             ({"prompt_ids": ["1,2"]}, "give --prompt TEXT, not --prompt-ids")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            chat_prompts(types.SimpleNamespace(**{**args, **changes}), info, ["hi"])


def test_speed_takes_out_the_compile_seconds_of_each_step():
    """compile_seconds() sorts JAX's compile events by the step's function name; Speed subtracts them."""
    import jax
    import jax.numpy as jnp

    from meshtrain.generation.engine import Timing
    from meshtrain.generation.speed import Speed, compile_seconds

    def prefill(x):
        return jnp.cumsum(x) * 3.0

    def helper(x):
        return x - 1.0

    with compile_seconds() as compiled:
        jax.jit(prefill)(jnp.arange(7.0)).block_until_ready()
        jax.jit(helper)(jnp.arange(5.0)).block_until_ready()  # neither step's: not counted
    assert compiled["prefill"] > 0 and compiled["decode"] == 0
    timing = Timing(batch=2, prompt_tokens=12, prefill_s=compiled["prefill"] + 0.5, decode_s=(0.25, 0.25, 0.5))
    speed = Speed.of(timing, prompt_tokens=10, new_tokens=8, rows=2, compiled={"prefill": compiled["prefill"],
                                                                               "decode": 0.5})
    assert speed.prefill_s == pytest.approx(0.5) and speed.prefill_tokens_per_s == pytest.approx(20.0)
    assert (speed.decode_tokens, speed.decode_s, speed.decode_tokens_per_s) == (6, 0.5, 12.0)
    assert speed.compile_s == pytest.approx(compiled["prefill"] + 0.5) and "(not counted)" in speed.line()
