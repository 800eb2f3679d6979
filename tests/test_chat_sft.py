"""Chat fine-tuning (issue 31, deliverable 4): `data prepare --chat` renders conversations with the
tokenizer's chat template and stores a loss mask over the assistant's tokens (equal to transformers'
``return_assistant_tokens_mask`` for a ``{% generation %}`` template); packing keeps it; changing a
masked token's target changes no gradient, exactly; a chat fine-tune of an imported tiny Llama trains
on the assistant's tokens only and lowers their loss; bad input is one `error:` line, exit 2."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_chat_template import BLOCKS, CHATML, LLAMA3, tokenizer_folder
from test_hf import SHAPE, hf_folder

import meshtrain as mt
from meshtrain.cli import main
from meshtrain.data.chat import ChatTemplate
from meshtrain.data.chat_sft import assistant_spans, token_mask
from meshtrain.data.loader import BatchIterator
from meshtrain.data.packing import pack_window
from meshtrain.data.sources import TokenSource, prepared_source
from meshtrain.data.tokenizer import load_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.hf import model_config
from meshtrain.losses import next_token_loss

transformers = pytest.importorskip("transformers")

#: a {% generation %} template whose assistant turns are the reply alone (no end token)
BARE = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "blocks": "<|im_end|>"}


def chats(count: int, seed: int = 0):
    """Short arithmetic conversations (a system turn, then one or two user / assistant exchanges)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        turns = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": f"What is {a} + {b}?"},
                 {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "Encore"}, {"role": "assistant", "content": f"{a + b}!"}]
        out.append(turns)
    return out


def write_jsonl(path, conversations, field="messages"):
    with open(path, "w") as f:
        for conversation in conversations:
            f.write(json.dumps({field: conversation}) + "\n")
    return str(path)


def prepare(capsys, folder, jsonl, out, *extra):
    code = main(["data", "prepare", "--chat", "--tokenizer", str(folder), "--input", str(jsonl), "--out", str(out),
                 *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def runs_of(mask: np.ndarray):
    """``(start, end)`` of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("name, template", [("chatml", CHATML), ("llama3", LLAMA3), ("blocks", BLOCKS)])
def test_the_mask_covers_each_assistant_reply_and_its_end_token(tmp_path, capsys, name, template):
    folder = tokenizer_folder(tmp_path / "tok", template)
    conversations = chats(6)
    code, out, err = prepare(capsys, folder, write_jsonl(tmp_path / "c.jsonl", conversations), tmp_path / "data")
    assert code == 0, err
    source = prepared_source(str(tmp_path / "data"))
    tokenizer = load_tokenizer(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ends = list(source.doc_starts[1:]) + [len(source)]
    assert len(ends) == len(conversations) and source.loss_mask is not None
    for conversation, start, end in zip(conversations, source.doc_starts, ends):
        ids, mask = np.asarray(source.tokens[start:end]), np.asarray(source.loss_mask[start:end])
        assert ids.tolist() == hf.apply_chat_template(conversation, tokenize=True)  # the ids transformers makes
        replies = [m["content"] + END[name] for m in conversation if m["role"] == "assistant"]
        assert [tokenizer.decode(ids[a:b]) for a, b in runs_of(mask)] == replies
        if name == "blocks":  # transformers marks the {% generation %} text itself: the same tokens
            theirs = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
            assert mask.tolist() == theirs["assistant_masks"]
    meta = json.loads((tmp_path / "data" / "tokens.json").read_text())
    assert meta["target_tokens"] == int(np.asarray(source.loss_mask).sum()) > 0
    assert f"{meta['target_tokens']:,} are the assistant's" in out


def test_packing_keeps_the_mask(tmp_path, capsys):
    folder = tokenizer_folder(tmp_path / "tok", CHATML)
    assert prepare(capsys, folder, write_jsonl(tmp_path / "c.jsonl", chats(12)), tmp_path / "data")[0] == 0
    source = prepared_source(str(tmp_path / "data"))
    tokens, mask = np.asarray(source.tokens).astype(np.int64), np.asarray(source.loss_mask)
    doc = np.searchsorted(source.doc_starts, np.arange(len(source)), side="right") - 1
    seq = 24
    counted = 0
    for index in range(len(source) // seq):
        window = pack_window(source, index, seq)
        t = np.arange(index * seq + 1, index * seq + seq + 1)  # the target tokens' positions in the stream
        expected = np.where((mask[t] == 1) & (doc[t] == doc[t - 1]), tokens[t], -1)
        assert window["targets"].tolist() == expected.tolist(), index
        counted += int((window["targets"] >= 0).sum())
    assert counted > 0
    train, val = source.split(0.25)  # the split carries the mask with the tokens
    assert np.array_equal(np.concatenate([train.loss_mask, val.loss_mask]), mask)
    with open(tmp_path / "data" / "loss_mask.bin", "ab") as f:  # a damaged folder is refused, naming the file
        f.write(b"\0")
    with pytest.raises(ConfigError, match=r"loss_mask.bin' is missing or not \d+ bytes \(one per token\)"):
        prepared_source(str(tmp_path / "data"))


def test_assistant_spans_need_an_assistant_turn_and_tokens_overlapping_count():
    conversation = chats(1)[0]
    text, spans = assistant_spans(ChatTemplate(CHATML), conversation)
    assert [text[a:b] for a, b in spans] == [m["content"] + "<|im_end|>" for m in conversation
                                             if m["role"] == "assistant"]
    first = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}]  # nothing before it
    text, spans = assistant_spans(ChatTemplate(LLAMA3, {"bos_token": "<s>"}), first)
    assert [text[a:b] for a, b in spans] == ["Hello.<|eot_id|>"]
    assert token_mask([(0, 2), (2, 5), (5, 5), (5, 9), (9, 9)], [(3, 5), (9, 12)]).tolist() == [0, 1, 0, 0, 1]


def test_bad_input_is_one_error_line(tmp_path, capsys):
    folder = tokenizer_folder(tmp_path / "tok", CHATML)
    good = json.dumps({"messages": chats(1)[0]})
    cases = [
        ([good, json.dumps({"messages": [{"role": "user", "content": "Hi"}]})],
         "{f}:2: the conversation has no assistant turn (roles: user)"),
        ([good, "", good, '{"messages": [oops]}'], "{f}:4: not a JSON object"),
        ([json.dumps({"text": "hello"})], "{f}:1: no list of messages under 'messages' (found ['text'])"),
        ([json.dumps({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})],
         "{f}:1: message 1 of a conversation for"),
        ([json.dumps({"messages": [{"role": "assistant", "content": " "}]})], "{f}:1: the conversation opens with "
                                                                               "an assistant turn without text"),
        ([json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]})],
         "the assistant's turns hold no tokens", BARE),
        ([good, json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"},
                                         {"role": "assistant", "content": "c"}]})],
         "{f}:2: the chat template refused the conversation: Only user and assistant roles are supported", BLOCKS),
    ]
    for i, (lines, message, *template) in enumerate(cases):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        tokenizer = tokenizer_folder(tmp_path / f"tok{i}", template[0]) if template else folder
        code, out, err = prepare(capsys, tokenizer, path, tmp_path / f"out{i}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("error: ") and message.format(f=path) in err, (message, err)
        assert not os.path.exists(tmp_path / f"out{i}")
    plain = tokenizer_folder(tmp_path / "plain", None)
    code, out, err = prepare(capsys, plain, write_jsonl(tmp_path / "ok.jsonl", chats(2)), tmp_path / "none")
    assert code == 2 and err.strip().splitlines() == [
        f"error: --chat: the tokenizer in {plain!r} has no chat template (no chat_template in its "
        f"tokenizer_config.json, no chat_template.jinja); pass --tokenizer with a model's folder that has one, or "
        f"prepare plain text without --chat"], err


@functools.partial(jax.jit, static_argnames="graphdef")
def _mean_loss_grads(params, batch, graphdef):
    def loss(p):
        total, count = next_token_loss(nnx.merge(graphdef, p), batch)[:2]
        return total / jnp.maximum(count, 1.0)

    return jax.grad(loss)(params)


def _grads(model, window):
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v)[None] for k, v in window.items()}
    return [np.asarray(g) for g in jax.tree.leaves(_mean_loss_grads(params, batch, graphdef))]


def test_a_masked_targets_value_changes_no_gradient(tmp_path, capsys):
    """The last target of a window is a token no position reads as input: changing it in the stream
    changes only that target. Where the mask leaves it out, every gradient is bit-identical; where it
    is the assistant's (or without the mask), the gradient changes."""
    folder = tokenizer_folder(tmp_path / "tok", CHATML)
    vocab = len(transformers.AutoTokenizer.from_pretrained(folder))
    src = str(tmp_path / "hf")  # a tiny HF Llama's config.json: the decoder an import builds (random weights)
    transformers.LlamaConfig(**{**SHAPE, "vocab_size": vocab, "num_hidden_layers": 1}).save_pretrained(src)
    assert prepare(capsys, folder, write_jsonl(tmp_path / "c.jsonl", chats(8)), tmp_path / "data")[0] == 0
    source = prepared_source(str(tmp_path / "data"))
    mask = np.asarray(source.loss_mask)
    doc = np.searchsorted(source.doc_starts, np.arange(len(source)), side="right") - 1
    seq = 24  # window i's last target is token (i + 1) * seq; keep windows where a document does not end there
    # and that hold some of the assistant's targets besides
    last = {i: (i + 1) * seq for i in range(len(source) // seq) if doc[(i + 1) * seq] == doc[(i + 1) * seq - 1]
            and mask[i * seq + 1:(i + 1) * seq].any()}
    masked, counted = (next(i for i, n in last.items() if mask[n] == want) for want in (0, 1))
    with nnx.use_eager_sharding(False):  # one device, no mesh
        model = mt.models.model_factory(model_config(src))(nnx.Rngs(0))

    def changed(n, loss_mask):
        tokens = np.array(source.tokens)
        tokens[n] = (tokens[n] + 1) % vocab
        return TokenSource("changed", tokens, source.doc_starts, vocab, "x", loss_mask)

    def equal_grads(i, before, after):
        a, b = pack_window(before, i, seq), pack_window(after, i, seq)
        assert np.array_equal(a["inputs"], b["inputs"])  # the changed token is a target only
        return [np.array_equal(x, y) for x, y in zip(_grads(model, a), _grads(model, b))]

    assert all(equal_grads(masked, source, changed(last[masked], mask)))  # every parameter, bit for bit
    assert not all(equal_grads(counted, source, changed(last[counted], mask)))  # an assistant target: it changes
    unmasked = TokenSource("plain", source.tokens, source.doc_starts, vocab, "y")
    assert not all(equal_grads(masked, unmasked, changed(last[masked], None)))  # without the mask it would change


@pytest.mark.slow
def test_chat_fine_tune_of_an_imported_llama_lowers_the_assistant_loss(tmp_path, capsys):
    folder = tokenizer_folder(tmp_path / "src", CHATML)
    vocab = len(transformers.AutoTokenizer.from_pretrained(folder))
    hf_folder(tmp_path / "src", "llama", vocab_size=vocab, max_position_embeddings=64)
    mt.train.interop.import_hf(folder, str(tmp_path / "run"))
    run = str(tmp_path / "run")
    assert prepare(capsys, run, write_jsonl(tmp_path / "c.jsonl", chats(96)), tmp_path / "data")[0] == 0
    config = mt.train.TrainConfig(model=run, init_from=run, data=str(tmp_path / "data"), recipe="dp", steps=12,
                                  batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2, val_fraction=0.25,
                                  eval_every=1, eval_batches=2, out=str(tmp_path / "ft"), progress="none")
    summary = mt.train.Trainer(config).run()
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    # the step's weight is the number of the assistant's targets in the batch, not every token
    train, _ = prepared_source(str(tmp_path / "data")).split(0.25)
    first = BatchIterator(train, 8, 32, seed=0, prefetch=0).local_batch(0)
    assistant = int((first["targets"] >= 0).sum())
    assert 0 < assistant < first["targets"].size // 2
    assert steps[0]["weight"] == assistant, (steps[0], assistant)
    evals = [r["eval_loss"] for r in steps if "eval_loss" in r]
    assert summary.steps == 12 and evals[-1] < evals[0] - 0.5, evals  # held-out conversations' replies
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [r["loss"] for r in steps]
