"""Chat templates rendered as transformers' ``apply_chat_template`` renders them: the same text and the
same token ids for chatml (SmolLM2-style), Llama-3-style (``bos_token``, ``| trim``) and block-style
templates (``trim_blocks`` / ``lstrip_blocks``, ``tojson``, ``{% generation %}``), with and without the
generation prompt; ``raise_exception`` and syntax errors as one-line errors naming the file."""

from __future__ import annotations

import json
import os

import pytest

from meshtrain.data.chat import ChatTemplateError, check_messages, load_chat_template
from meshtrain.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

#: SmolLM2-Instruct's template: chatml with a default system turn
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: Llama-3-Instruct's template: bos_token first, each turn's content trimmed
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
#: block statements on their own lines (trim_blocks / lstrip_blocks decide the whitespace), tojson,
#: loop controls, role checks and the generation tag
BLOCKS = """{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'Be brief.' %}
{%- endif %}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in messages %}
    {% if message.role not in ['user', 'assistant'] %}
        {{ raise_exception('Only user and assistant roles are supported, not ' + message.role) }}
    {% endif %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

    {% else %}
<|im_start|>user
{{ message.content | tojson }} {{ eos_token if loop.last else '' }}<|im_end|>
    {% endif %}
    {% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "What is 2 + 2?\nAnswer  with a number."}],
    [{"role": "user", "content": "  Écris un <b>poème</b> & \"cite\" 'moi'  "},
     {"role": "assistant", "content": "Des roses, 🌹\n\tdes mots."},
     {"role": "user", "content": "Encore"}],
]


def tokenizer_folder(path, template, **config):
    """A byte-level BPE tokenizer (learned here) with the chat special tokens, saved as a HuggingFace
    tokenizer folder whose tokenizer_config.json carries ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [" ".join(c["content"] for c in conv) for conv in CONVERSATIONS] * 20 + ["system user assistant"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}, "chat_template": template, **config}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f)
    return str(path)


@pytest.mark.parametrize("name, template", [("chatml", CHATML), ("llama3", LLAMA3), ("blocks", BLOCKS)])
def test_text_and_ids_equal_transformers_apply_chat_template(tmp_path, name, template):
    folder = tokenizer_folder(tmp_path / name, template)
    ours, tokenizer = load_chat_template(folder), load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            text = ours.render(conversation, add_generation_prompt=prompt)
            assert text == theirs.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=False)
            ids = theirs.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=True)
            assert tokenizer.encode(text) == list(ids), (name, conversation, prompt)
    special = tokenizer.encode(ours.render(CONVERSATIONS[0], add_generation_prompt=True))
    assert {theirs.convert_tokens_to_ids("<|im_start|>"), theirs.convert_tokens_to_ids("<|start_header_id|>")} & \
        set(special), "the template's special tokens encode as their own ids"


def test_generation_spans_cover_the_assistant_text_and_jinja_file_wins(tmp_path):
    folder = tokenizer_folder(tmp_path / "t", CHATML)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:  # transformers: the file over the config
        f.write(BLOCKS)
    template = load_chat_template(folder)
    text, spans = template.render_spans(CONVERSATIONS[2])
    assert text == transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(CONVERSATIONS[2],
                                                                                         tokenize=False)
    assert [text[a:b] for a, b in spans] == ["Des roses, 🌹\n\tdes mots.<|im_end|>"]
    assert template.render(CONVERSATIONS[0]).endswith('"Hi!" <|im_end|><|im_end|>\n')  # eos_token's content


def test_refusals_and_bad_templates_are_one_line_errors(tmp_path):
    template = load_chat_template(tokenizer_folder(tmp_path / "a", BLOCKS))
    with pytest.raises(ChatTemplateError, match="refused the conversation: Only user and assistant roles are "
                                                "supported, not tool"):
        template.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"message 1 .* give an object with a string \"role\""):
        check_messages([{"role": "user", "content": "a"}, {"content": "b"}])
    bad = tokenizer_folder(tmp_path / "b", "{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json: the chat template does not compile \(line 1"):
        load_chat_template(bad)
    assert load_chat_template(tokenizer_folder(tmp_path / "c", None)) is None
    named = tokenizer_folder(tmp_path / "d", [{"name": "tool_use", "template": "x"}, {"name": "default",
                                                                                      "template": CHATML}])
    assert load_chat_template(named).source == CHATML
