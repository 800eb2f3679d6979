"""``meshtrain serve``: an imported tiny Llama with a chat template, served over HTTP by a child process
(one per module, started on a free port; every wait bounded).

* the official ``openai`` client streams a chat completion whose tokens are ``meshtrain generate --chat``'s
  greedy tokens, ending at the end-of-sequence id;
* overload answers 429 with ``Retry-After`` and every accepted request completes; a client that goes
  away frees its slot; SIGTERM with requests in flight completes them and exits 0;
* bad requests get 4xx with OpenAI's error body naming the field, and no traceback in the log.

The fast tests check the pieces without a server: request parsing, the text stream's stop texts, and
the slotted cache's tokens against the generation engine's.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import processes
import pytest
from helpers import make_decoder
from test_chat_template import CHATML, tokenizer_folder
from test_hf import hf_folder

from meshtrain.cli import main
from meshtrain.generation.api import load
from meshtrain.serving.protocol import ApiError, Kind, ServedModel, parse
from meshtrain.serving.scheduler import TextStream
from meshtrain.errors import ConfigError
from meshtrain.serving.slots import MAX_STEPS, RowSampling, SamplingRows, Slots

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
CONTEXT = 4096  # long enough that LONG cannot end before its client goes away, even on a starved machine
#: a request that runs for a while (no stop at the end-of-sequence ids)
LONG = {"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
BOUND_S = 600  # for any one wait on the server: generous on a busy 2-core machine


# -- fast: the pieces ---------------------------------------------------------------------------------------
MODEL = ServedModel("m", 64, 100, (3,), lambda text: [ord(c) % 100 for c in text],
                    lambda messages: "".join(m["content"] for m in messages))


@pytest.mark.parametrize("kind, body, status, param", [
    (Kind.COMPLETION, {"model": "x", "prompt": "hi"}, 404, "model"),
    (Kind.COMPLETION, {"prompt": "hi"}, 400, "model"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "max_tokens": 63}, 400, "max_tokens"),
    (Kind.COMPLETION, {"model": "m", "prompt": "x" * 64}, 400, "prompt"),
    (Kind.COMPLETION, {"model": "m", "prompt": [1, 100]}, 400, "prompt"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "n": 2}, 400, "n"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    (Kind.COMPLETION, {"model": "m", "prompt": "hi", "stop": 3}, 400, "stop"),
    (Kind.CHAT, {"model": "m", "messages": []}, 400, "messages"),
    (Kind.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools"),
    (Kind.CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
])
def test_bad_requests_name_the_field(kind, body, status, param):
    with pytest.raises(ApiError) as info:
        parse(kind, body, MODEL)
    err = info.value
    assert (err.status, err.param) == (status, param) and err.body()["error"]["param"] == param
    assert err.body()["error"]["message"].startswith(f"{param}: "), err.body()


def test_good_requests_and_their_defaults():
    r = parse(Kind.CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}],
                          "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}, MODEL)
    assert r.job.prompt_ids == (97, 98) and r.job.max_tokens == 62 and r.job.stop_ids == {3}
    assert r.stream and r.include_usage and r.job.sampling.temperature == 0
    r = parse(Kind.COMPLETION, {"model": "m", "prompt": [[1, 2]], "seed": -1, "ignore_eos": True, "stop": "x"}, MODEL)
    assert r.job.prompt_ids == (1, 2) and r.job.max_tokens == 16 and r.job.stop_ids == frozenset()
    assert r.job.sampling.seed == 2 ** 32 - 1 and r.job.stop_texts == ("x",)


def test_text_stream_holds_back_what_could_start_a_stop_text():
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), ("END",))
    pieces = [stream.push(ord(c)) for c in "abEN"]
    assert pieces == [("a", False), ("b", False), ("", False), ("", False)]  # "EN" may begin "END"
    assert stream.push(ord("X")) == ("ENX", False)
    assert stream.push(ord("E")) == ("", False)
    assert stream.push(ord("N")) == ("", False) and stream.push(ord("D")) == ("", True)
    partial = TextStream(lambda ids: "é\ufffd"[:len(ids)], ())
    assert partial.push(1) == ("é", False) and partial.push(2) == ("", False) and partial.rest() == "\ufffd"


def test_text_stream_decodes_incrementally_as_the_whole_text():
    """A tokenizer that drops the leading space of what it decodes (as SentencePiece does) and spells a
    character in two ids: the pieces add up to the whole text's decode, and no piece is decoded whole."""
    spelled = {1: " the", 2: " cat", 3: "\xc3", 4: "\xa9", 5: " sat", 6: "."}
    calls = []

    def decode(ids):
        calls.append(len(ids))
        raw = "".join(spelled[i] for i in ids).encode("latin-1").decode("utf-8", errors="replace")
        return raw[1:] if raw.startswith(" ") else raw

    ids = [1, 2, 3, 4, 5, 6, 1, 2, 5, 6] * 4
    stream = TextStream(decode, ("cat sat",))
    pieces = [stream.push(i) for i in ids[:2]]
    assert "".join(p for p, _ in pieces) == "the "  # "cat" may begin the stop text: held back
    expected, whole = decode(ids), TextStream(decode, ())
    calls.clear()
    assert "".join(whole.push(i)[0] for i in ids) + whole.rest() == expected
    assert max(calls) <= 3  # the ids since the last piece and their context, never the whole list
    assert "".join(p for p, _ in (stream.push(i) for i in ids[2:7])) == "caté sat. the"
    assert stream.push(2) == (" ", False) and stream.push(5) == ("", True)  # "... the cat sat": stopped


def test_slots_decode_several_steps_in_one_program():
    """Two requests join in one prefill program (``admit_many``), then ``Slots.decode(steps=k)`` runs k
    steps in one program: the engine's tokens, one prompt at a time, for rows of different lengths."""
    prompts, n_new = [[1, 2, 3, 4, 5], list(range(10, 30))], 9
    engine = load(make_decoder("tiny"), recipe="dp", devices=1).engine
    reference = [list(g.new_ids) for g in engine.run(prompts, n_new).generations]
    slots = Slots(engine, 2, 64)
    last, length, sampling = np.zeros(2, np.int32), np.zeros(2, np.int32), SamplingRows.empty(2)
    first, _ = slots.admit_many([(1, prompts[1], RowSampling()), (0, prompts[0], RowSampling())])  # one program
    for slot, prompt in enumerate(prompts):
        last[slot], length[slot] = first[1 - slot], len(prompt)
        sampling.set(slot, RowSampling(), step=1)
    out = [[int(last[0])], [int(last[1])]]
    for steps in (1, 8):  # 1 + 1 + 8 = 10 > n_new: the last token is past the reference's
        tokens_kb, logprobs_kb = slots.decode(last, length, sampling, used=2, steps=steps)
        assert tokens_kb.shape == logprobs_kb.shape == (steps, 2) and np.all(logprobs_kb <= 0)
        for b in range(2):
            out[b] += [int(t) for t in tokens_kb[:, b]]
        last, length = tokens_kb[-1].astype(np.int32), length + steps
        sampling.step_b[:] += steps
    assert [o[:n_new] for o in out] == reference
    with pytest.raises(ConfigError, match="decode steps"):
        slots.decode(last, length, sampling, steps=MAX_STEPS + 1)


JOIN_AND_LEAVE_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]


@functools.lru_cache(maxsize=1)
def _one_device_reference():
    """The tiny engine on one device and its 6 greedy tokens for each prompt: computed once, read by both
    recipes' cases below."""
    engine = load(make_decoder("tiny"), recipe="dp", devices=1).engine
    return engine, [list(g.new_ids) for g in engine.run(JOIN_AND_LEAVE_PROMPTS, 6).generations]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, devices", [("dp", 1), ("fsdp_tp", 8)])
def test_slots_decode_the_engines_tokens_while_requests_join_and_leave(recipe, devices):
    """Against the engine on one device: the slotted cache on the recipe's plan (fsdp_tp: the cache's
    kv heads over ``tensor``, the weights over ``fsdp`` and ``tensor``)."""
    prompts = JOIN_AND_LEAVE_PROMPTS
    one_device, reference = _one_device_reference()
    # (on one device the reference's own engine is the one slotted: the same weights and plan)
    engine = one_device if devices == 1 else load(make_decoder("tiny"), recipe=recipe, devices=devices).engine
    slots = Slots(engine, 2, 64)
    n = slots.n  # 2, or more: a multiple of the data-parallel size
    last, length, sampling, out = np.zeros(n, np.int32), np.zeros(n, np.int32), SamplingRows.empty(n), {}

    def join(slot, i):
        last[slot], _ = slots.admit(slot, prompts[i], RowSampling())
        length[slot], out[i] = len(prompts[i]), [int(last[slot])]
        sampling.set(slot, RowSampling(), step=1)

    join(0, 0)
    for step in range(5):  # prompt 1 joins at step 2 in slot 1; prompt 2 takes slot 0 when prompt 0 is done
        if step == 2:
            join(1, 1)
        tokens, _ = slots.step(last, length, sampling, used=1 if step < 2 else 2)  # slot 1 idle: not run
        for slot, i in ((0, 0), (1, 1)):
            if i in out and len(out[i]) < 6:
                out[i].append(int(tokens[slot]))
        last[:len(tokens)], length = tokens, length + 1
    join(0, 2)
    for _ in range(5):
        tokens, _ = slots.step(last, length, sampling, used=2)
        for slot, i in ((0, 2), (1, 1)):
            if len(out[i]) < 6:
                out[i].append(int(tokens[slot]))
        last[:len(tokens)], length = tokens, length + 1
    assert [out[i] for i in range(3)] == reference


# -- slow: the server ---------------------------------------------------------------------------------------
class Served:
    """The server child: started on first use, and again if a test stopped it (SIGTERM)."""

    def __init__(self, run: str, folder):
        self.run, self.folder, self.proc, self.starts = run, folder, None, 0

    def start(self):
        self.starts += 1
        self.log = self.folder / f"server-{self.starts}.log"
        self.out = self.folder / f"server-{self.starts}.out"
        with open(self.out, "w") as out, open(self.log, "w") as err:
            self.proc = processes.start([sys.executable, "-m", "meshtrain", "serve", self.run, "--port", "0",
                                         "--recipe", "dp", "--devices", "1", "--max-batch", "2", "--max-queue", "2",
                                         "--model-name", "tiny-chat"], stdout=out, stderr=err)
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            line = next((w for w in self.out.read_text().splitlines() if w.startswith("serving ")), None)
            if line:
                self.host, self.port = line.rsplit("http://", 1)[1].rsplit(":", 1)
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        processes.kill(self.proc)
        pytest.fail("the server did not start within the bound")

    def connection(self) -> http.client.HTTPConnection:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return http.client.HTTPConnection(self.host, int(self.port), timeout=BOUND_S)

    def request(self, method, path, body=None):
        """``(status, headers, decoded JSON body)``."""
        conn = self.connection()
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        out = response.status, dict(response.getheaders()), json.loads(response.read() or b"{}")
        conn.close()
        return out

    def stream(self, body):
        """An open streamed completion: ``(connection, response)``, its first event read."""
        conn = self.connection()
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "model": "tiny-chat", "stream": True,
                                                                "return_token_ids": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        return conn, response


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The served run (an imported tiny Llama with a chatml tokenizer whose generation_config.json makes the
    chat prompt's 4th greedy token an end id) and ``generate --chat``'s greedy ids for CONVERSATION."""
    transformers = pytest.importorskip("transformers")
    from meshtrain.train.interop import import_hf

    d = tmp_path_factory.mktemp("serve")
    source = tokenizer_folder(d / "src", CHATML)
    vocab = transformers.AutoTokenizer.from_pretrained(source)
    hf_folder(d / "src", "llama", vocab_size=len(vocab), max_position_embeddings=CONTEXT)
    import_hf(source, str(d / "run"))
    run = str(d / "run")
    argv = ["generate", run, "--chat", "--system", "Be brief.", "--prompt", "What is 2 + 2?", "--max-new-tokens", "8",
            "--json", "--recipe", "dp", "--devices", "1"]
    free = _generate(argv + ["--stop-ids", "none"])
    with open(os.path.join(run, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [free[3]]}, f)
    expected = _generate(argv)  # stops at the first end id (the 4th token, or the tokenizer's eos before it)
    server = Served(run, d)
    yield server, expected, vocab
    if server.proc is not None:
        processes.kill(server.proc)


def _generate(argv):
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return json.loads(buffer.getvalue().strip().splitlines()[-1])["new_ids"]


@pytest.mark.slow
def test_openai_client_streams_generate_chats_tokens_and_stops_at_eos(served):
    openai = pytest.importorskip("openai")
    server, expected, vocab = served
    server.connection().close()  # started
    client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="unused", timeout=BOUND_S,
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=CONVERSATION, temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert ids == expected and len(ids) <= 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert text == vocab.decode(ids[:-1])  # the end id's text is not shown
    assert chunks[-1].usage.completion_tokens == len(ids)
    whole = client.chat.completions.create(model="tiny-chat", messages=CONVERSATION, temperature=0, max_tokens=8)
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_bad_requests_get_4xx_naming_the_field_and_no_traceback(served):
    server, _, _ = served
    chat = {"model": "tiny-chat", "messages": CONVERSATION}
    cases = [(b"{not json", 400, "body"), ({**chat, "model": "gpt-4"}, 404, "model"),
             ({**chat, "max_tokens": -3}, 400, "max_tokens"), ({**chat, "logit_bias": {"1": 5}}, 400, "logit_bias"),
             ({"model": "tiny-chat", "prompt": [5] * CONTEXT}, 400, "prompt")]
    for body, status, param in cases:
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        got, _, answer = server.request("POST", path, body)
        assert (got, answer["error"]["param"]) == (status, param), answer
        assert answer["error"]["message"] and answer["error"]["type"]
    assert server.request("GET", "/health")[2]["status"] == "ok"
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow
def test_overload_answers_429_and_loses_nothing(served):
    server, _, _ = served
    body = {**LONG, "model": "tiny-chat", "max_tokens": 200}
    with ThreadPoolExecutor(10) as pool:  # 2 slots, 2 waiting: the rest are refused
        results = list(pool.map(lambda _: server.request("POST", "/v1/completions", body), range(10)))
    served_ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served_ok) + len(refused) == 10 and refused and len(served_ok) >= 2, [r[0] for r in results]
    assert all(int(h["retry-after"]) >= 1 and a["error"]["type"] == "rate_limit_exceeded" for _, h, a in refused)
    assert all(a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 200
               for _, _, a in served_ok)
    assert server.request("POST", "/v1/completions", {**body, "max_tokens": 2})[0] == 200


@pytest.mark.slow
def test_a_client_that_goes_away_frees_its_slot(served):
    server, _, _ = served
    before = server.request("GET", "/health")[2]["finished"]["cancelled"]
    for _ in range(2):
        # Each client dies right after its first token (the response's file holds the socket): 4,000 tokens
        # (~10 s here) cannot be generated in between, so the request ends cancelled, not by its length.
        conn, response = server.stream(LONG)
        conn.sock.shutdown(socket.SHUT_RDWR)
        response.close()
        conn.close()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        health = server.request("GET", "/health")[2]
        if health["finished"]["cancelled"] == before + 2 and health["running"] == 0:
            break
        time.sleep(0.1)
    assert health["finished"]["cancelled"] == before + 2 and health["running"] == 0, health
    status, _, answer = server.request("POST", "/v1/completions", {**LONG, "model": "tiny-chat", "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_and_exits_0(served):
    server, _, _ = served
    streams = [server.stream({**LONG, "max_tokens": 150}) for _ in range(2)]
    server.proc.send_signal(signal.SIGTERM)
    finished = []

    def drain(response):
        events = [line[6:].strip() for line in response.read().decode().splitlines() if line.startswith("data: ")]
        finished.append((events[-1], json.loads(events[-2])["choices"][0]["finish_reason"],
                         sum(1 for e in events[:-1] if json.loads(e)["choices"][0]["text"])))

    threads = [threading.Thread(target=drain, args=(r,)) for _, r in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert [f[:2] for f in finished] == [("[DONE]", "length")] * 2, finished
    assert processes.wait(server.proc, timeout=BOUND_S) == 0
    assert "Traceback" not in server.log.read_text()
