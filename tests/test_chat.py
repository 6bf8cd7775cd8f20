"""Chat templates: rendered as transformers renders them, checked messages, and chat requests
through a real cluster."""

import json
import re
import shutil

import pytest

from common.chat import DUMMY_CHAT_TEMPLATE, ChatTemplate, TemplateArgs, check_messages
from common.model_spec import load_tokenizer
from common.errors import InvalidArgument, ModelLoadError
from common.tokenizer import ByteTokenizer
from tests.checkpoints import write_checkpoint
from router.client import Client, RequestError
from router.prompts import Prompts
from tests.cluster import cluster

# Llama-3-style: bos in the text, a system default, an error for a bad role order.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.index0 % 2 == 1 and messages[0]['role'] != 'system' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " the quick fox "},
                {"role": "assistant", "content": "hello world"}, {"role": "user", "content": [
                    {"type": "text", "text": "the lazy"}, {"type": "text", "text": "dog"}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "llama"
    write_checkpoint(path, "llama-gqa")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module")
def render_both(checkpoint):
    """render_both(source, messages) -> (ours, transformers'): the template source with the checkpoint's
    special tokens, rendered with a generation prompt."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    tokens = load_tokenizer(str(checkpoint)).chat_template.tokens

    def render(source, messages):
        return (ChatTemplate(source, **tokens).render(messages),
                ref.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=True))
    return render


def test_checkpoint_template_renders_and_encodes_as_transformers(checkpoint):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    tok = load_tokenizer(str(checkpoint))
    # text parts joined by newlines, as vLLM joins them
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "the lazy\ndog"}
             for m in CONVERSATION]
    for gen in (True, False):
        text = ref.apply_chat_template(plain, tokenize=False, add_generation_prompt=gen)
        assert tok.chat_template.render(CONVERSATION, add_generation_prompt=gen) == text
        expected = ref.apply_chat_template(plain, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert tok.encode_chat(CONVERSATION, add_generation_prompt=gen) == list(expected)
    assert tok.encode_chat(CONVERSATION).count(ref.bos_token_id) == 1  # the template's BOS, not a second one
    ids = tok.encode("the quick fox, é")
    assert tok.token_strs(ids) == ref.convert_ids_to_tokens(ids)  # /tokenize's return_token_strs


def test_continue_final_message_renders_as_transformers(checkpoint, render_both):
    """The prompt ends where the last message's text ends, as transformers' apply_chat_template
    cuts it: in a template that trims the content (TEMPLATE) and one that keeps it whole."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    tok = load_tokenizer(str(checkpoint))
    for source in (TEMPLATE, DUMMY_CHAT_TEMPLATE):
        template = ChatTemplate(source, **tok.chat_template.tokens)
        for answer in ("The answer is", "The answer is ", " 4\n"):
            conversation = [*CONVERSATION[:2], {"role": "assistant", "content": answer}]
            want = ref.apply_chat_template(conversation, chat_template=source, tokenize=False,
                                           add_generation_prompt=False, continue_final_message=True)
            assert template.render(conversation, False, continue_final_message=True) == want, (source, answer)
    with pytest.raises(InvalidArgument, match="add_generation_prompt=false") as e:
        tok.encode_chat(CONVERSATION, continue_final_message=True)  # add_generation_prompt is true unless said
    assert e.value.param == "continue_final_message"
    with pytest.raises(InvalidArgument, match="does not end it with its content") as e:
        ChatTemplate("{% for m in messages[:-1] %}{{ m['content'] }}{% endfor %}").render(
            CONVERSATION, False, continue_final_message=True)
    # through the HTTP front's path, and /tokenize's
    from router.http import _prepare
    from router.openai_api import parse_chat, parse_tokenize

    prompts = Prompts(str(checkpoint))
    started = [*CONVERSATION, {"role": "assistant", "content": "It is"}]
    want = tok.encode_chat(started, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(want).endswith("<|assistant|>It is")
    body = {"messages": started, "add_generation_prompt": False, "continue_final_message": True}
    _, [(ids, _)] = _prepare(lambda b: parse_chat(b, "m", 1024), {**body, "max_tokens": 1}, prompts, 16)
    asked = parse_tokenize(body, "m")
    assert ids == want == prompts.encode(asked.prompt, asked.messages, asked.template)
    with pytest.raises(InvalidArgument) as e:
        _prepare(lambda b: parse_chat(b, "m", 1024), {**body, "add_generation_prompt": True}, prompts, 16)
    assert e.value.param == "continue_final_message"


def test_add_special_tokens_is_each_endpoints_own_unless_a_request_says(checkpoint):
    """vLLM's add_special_tokens: a prompt's text gets the tokenizer's BOS and a chat's template
    writes its own, unless the request says otherwise, on the HTTP front's path and /tokenize's."""
    from router.http import _prepare
    from router.openai_api import parse_chat, parse_completion

    prompts, bos = Prompts(str(checkpoint)), load_tokenizer(str(checkpoint)).encode("", add_special_tokens=True)
    assert len(bos) == 1
    text, chat = prompts.encode("hello", None, add_special_tokens=False), prompts.encode("", CONVERSATION)
    assert text and bos[0] not in text and chat.count(bos[0]) == 1  # the template's
    for body, ids in (({"prompt": "hello"}, bos + text), ({"prompt": "hello", "add_special_tokens": False}, text),
                      ({"messages": CONVERSATION}, chat), ({"messages": CONVERSATION, "add_special_tokens": True},
                                                            bos + chat)):
        parse = (lambda b: parse_chat(b, "m", 1024)) if "messages" in body else (lambda b: parse_completion(b, "m"))
        _, [(got, _)] = _prepare(parse, {**body, "max_tokens": 1}, prompts, 16)
        assert got == ids, body
        assert prompts.encode(body.get("prompt"), body.get("messages"),
                              add_special_tokens=body.get("add_special_tokens")) == ids  # /tokenize's


def test_an_sdk_request_takes_add_special_tokens_as_an_http_one(checkpoint, tmp_path):
    prompts, bos = Prompts(str(checkpoint)), load_tokenizer(str(checkpoint)).encode("", add_special_tokens=True)
    text, chat = prompts.encode("hello", None, add_special_tokens=False), prompts.encode("", CONVERSATION)
    with cluster(tmp_path, model=str(checkpoint), prefill=0, decode=0, mono=1) as c, Client(c.address) as client:
        for request, ids in ((dict(prompt="hello"), bos + text), (dict(prompt="hello", add_special_tokens=False), text),
                             (dict(messages=CONVERSATION), chat),
                             (dict(messages=CONVERSATION, add_special_tokens=True), bos + chat)):
            assert client.generate(**request, max_tokens=1).prompt_token_ids == ids, request
        with pytest.raises(RequestError, match="add_special_tokens"):
            client.generate("hello", max_tokens=1, add_special_tokens="no")
        # a chat's template options, as over HTTP
        started = [*CONVERSATION, {"role": "assistant", "content": "It is"}]
        tok = load_tokenizer(str(checkpoint))
        for options in (dict(add_generation_prompt=False, continue_final_message=True),
                        dict(add_generation_prompt=False), dict(chat_template_kwargs={"unused": 1})):
            want = tok.encode_chat(started, options.get("add_generation_prompt", True),
                                   continue_final_message=options.get("continue_final_message", False))
            assert client.generate(messages=started, max_tokens=1, **options).prompt_token_ids == want, options
        for options, said in ((dict(continue_final_message=True), "add_generation_prompt=false"),
                              (dict(chat_template_kwargs={"messages": []}), "sets ['messages']")):
            with pytest.raises(RequestError, match=re.escape(said)):
                client.generate(messages=started, max_tokens=1, **options)
        with pytest.raises(InvalidArgument, match="continue_final_message without messages"):
            client.generate("hello", max_tokens=1, continue_final_message=True)


_ADDED = {"0": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": True}}


@pytest.mark.parametrize("config, special_tokens_map", [
    ({}, {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False, "special": True},
          "unk_token": "<s>", "pad_token": "</s>"}),
    ({"bos_token": "</s>", "eos_token": "<s>", "pad_token": "<s>"}, {"bos_token": "<s>", "eos_token": "</s>"}),
    ({"added_tokens_decoder": _ADDED, "bos_token": "<s>"}, {"eos_token": "</s>", "unk_token": "<s>"}),
], ids=["only-in-the-map", "map-over-config", "map-ignored-beside-added-tokens"])
def test_special_tokens_map_json_gives_the_templates_tokens_as_in_transformers(checkpoint, tmp_path, config,
                                                                              special_tokens_map):
    """Tokens only in special_tokens_map.json rendered as '' ('[user] hello world', transformers
    '<s>[user] hello world</s>'): transformers reads that file where tokenizer_config.json has no
    added_tokens_decoder (an older checkpoint), its tokens over the config's."""
    from transformers import AutoTokenizer

    path = shutil.copytree(checkpoint, tmp_path / "ck")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "[{{ unk_token }}|{{ pad_token }}]" + TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
         **config}))
    (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    ref = AutoTokenizer.from_pretrained(str(path))
    tok = load_tokenizer(str(path))
    messages = [{"role": "user", "content": "hello world"}]
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<s>" in text  # the case is one with tokens to render
    assert tok.chat_template.render(messages) == text
    assert tok.encode_chat(messages) == list(ref.apply_chat_template(messages, add_generation_prompt=True,
                                                                     return_dict=False))


def test_template_errors_name_the_problem(checkpoint):
    tok = load_tokenizer(str(checkpoint))
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ModelLoadError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}", origin="x")
    with pytest.raises(Exception, match="access to attribute"):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])


def test_other_message_keys_and_variables_reach_the_template_as_in_transformers(render_both):
    source = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{% if m.name is defined %}({{ m.name }}){% endif %}"
        "{{ m.content }}{% for call in m.tool_calls or [] %}[{{ call.function.name }}"
        "{{ call.function.arguments | tojson }}]{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}"
        "{{ eos_token }}{% endfor %}{{ tools is none }} {{ documents is none }} {{ pad_token }}"
        " {{ unk_token is defined }} {{ add_generation_prompt }}")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": [2.5, None]}}}
    messages = [{"role": "user", "content": "add", "name": "ann"}, {"role": "assistant", "content": None,
                "tool_calls": [call], "name": None}, {"role": "tool", "content": "3.5", "tool_call_id": "c1"}]
    ours, theirs = render_both(source, messages)
    assert ours == theirs and "(ann)" in ours and '[add{"a": 1, "b": [2.5, null]}]' in ours and "#c1" in ours
    assert ours.endswith("True True </s> False True")
    # OpenAI's clients send a call's arguments as a JSON string; templates get the object, as vLLM has it
    as_sent = {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
    assert render_both(source, [messages[0], {**messages[1], "tool_calls": [as_sent]}, messages[2]])[0] == ours
    with pytest.raises(InvalidArgument, match=r"messages\[1\].tool_calls\[0\].function.arguments='{a' is invalid"):
        check_messages([messages[0], {**messages[1], "tool_calls": [{"function": {"name": "f", "arguments": "{a"}}]}])


TOOLS_TEMPLATE = ("{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}"
                  "{% endfor %}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_a_chats_tools_reach_the_template_as_transformers_passes_them(render_both, checkpoint, tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    messages = [{"role": "user", "content": "Weather?"}]
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    ours = ChatTemplate(TOOLS_TEMPLATE, **load_tokenizer(str(checkpoint)).chat_template.tokens).render(messages,
                                                                                                     tools=tools)
    assert ours == ref.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
    assert ours.startswith('Tools: get_weather{"type": "object", "properties": {"city": {}}}')
    # and through the router's path: a checkpoint with such a template, its prompt ids as the HTTP front makes them
    shutil.copytree(checkpoint, tmp_path / "tools")
    config = json.loads((tmp_path / "tools" / "tokenizer_config.json").read_text())
    (tmp_path / "tools" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    prompts = Prompts(str(tmp_path / "tools"))
    ids, _ = prompts.validate("", messages, {"max_tokens": 1}, template=TemplateArgs(tools))
    assert "get_weather" in prompts.text(ids) and "get_weather" not in prompts.text(
        prompts.validate("", messages, {"max_tokens": 1})[0])


def test_jinja_environment_is_transformers(render_both):
    """{% generation %} (transformers' training masks) renders its body, in its own scope; tojson
    takes transformers' arguments; strftime_now is there."""
    source = (
        "{% for m in messages %}{% set x = 'outer' %}{% generation %}{% set x = 'inner' %}"
        "{{ m.content }}{% endgeneration %}{{ x }}{% endfor %}"
        "{{ messages | tojson(indent=2, separators=(',', '= '), sort_keys=True) }}"
        "{{ 'é' | tojson }}{{ 'é' | tojson(ensure_ascii=True) }}{{ strftime_now('%Y') }}")
    ours, theirs = render_both(source, [{"role": "user", "content": "<é>"}])
    assert ours == theirs and "<é>outer" in ours and '"content"= "<é>"' in ours


@pytest.mark.parametrize("source, error", [
    ("{{ raise_exception('no ' + messages[0].role) }}", "TemplateError: no user"),
    ("{{ messages | tojson(separators=1) }}", "TypeError"), ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[5].content.upper() }}", "UndefinedError"),
])
def test_template_failures_are_invalid_arguments(source, error):
    """A template's failure of any kind is a bad request (HTTP 400) naming it, not a server error."""
    with pytest.raises(InvalidArgument, match=f"cannot be rendered by the chat template: {error}"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_any_role_renders_as_in_transformers(render_both):
    """vLLM and transformers take any role: Llama 3.1's ipython, function, critic."""
    messages = [{"role": role, "content": role} for role in ("system", "user", "ipython", "function", "critic")]
    ours, theirs = render_both(TEMPLATE, messages)
    assert ours == theirs and "<|ipython|>ipython</s>" in ours


@pytest.mark.parametrize("bad, field", [
    ([], "messages="), ("hi", "messages="), ([{"role": "", "content": "x"}], r"messages\[0\].role"),
    ([{"role": 3, "content": "x"}], r"messages\[0\].role"), ([{"content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": "x", "name": b"bob"}], r"messages\[0\].name"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": {1, 2}}]}], r"messages\[0\].tool_calls"),
    ([{"role": "user", "content": "x", "metadata": {1: "a"}}], r"messages\[0\].metadata"),
    ([{"role": "user", "content": "x", 1: "a"}], r"messages\[0\] has the key 1"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\].content\[0\]"),
    ([{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}], r"messages\[0\].content\[0\]"),
    ([{"role": "user", "content": ["hi"]}], r"messages\[0\].content\[0\]"),
])
def test_bad_messages(bad, field):
    with pytest.raises(InvalidArgument, match=field):
        check_messages(bad)


def test_a_refusal_part_is_its_text():
    """OpenAI's schema lets an assistant's content hold refusal parts; vLLM renders them as text."""
    parts = [{"type": "text", "text": "I see."}, {"type": "refusal", "refusal": "I won't."}]
    checked = check_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": parts}])
    assert checked[1]["content"] == "I see.\nI won't."


def test_an_assistants_reasoning_reaches_the_template_under_both_names():
    """Clients send a turn's reasoning back as `reasoning` (vLLM's) or `reasoning_content`
    (DeepSeek's); templates read one or the other (Qwen3's: reasoning_content)."""
    template = ChatTemplate("{% for m in messages %}[{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}")
    for name in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", "content": "4", name: "2+2"}
        assert template.render([{"role": "user", "content": "2+2?"}, turn]) == "[|][2+2|2+2]"
    both = {"role": "assistant", "content": "4", "reasoning": "a", "reasoning_content": "b"}
    assert template.render([both]) == "[b|a]"  # each as given


def test_dummy_template():
    tok = ByteTokenizer()
    text = tok.chat_template.render([{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Hello"}])
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHello\n<|assistant|>\n"
    assert tok.encode_chat([{"role": "user", "content": "Hi"}]) == list(b"<|user|>\nHi\n<|assistant|>\n")
    assert ChatTemplate(DUMMY_CHAT_TEMPLATE).render([{"role": "user", "content": "Hi"}]) == "<|user|>\nHi\n<|assistant|>\n"


def test_chat_through_cluster_equals_prompt_of_rendered_text(tmp_path):
    messages = [{"role": "user", "content": "Hello"}]
    rendered = ByteTokenizer().chat_template.render(messages)
    with cluster(tmp_path) as c:
        with Client(c.address) as client:
            by_chat = client.generate(messages=messages, max_tokens=8, temperature=0)
            by_text = client.generate(rendered, max_tokens=8, temperature=0)
            assert by_chat.prompt_token_ids == list(rendered.encode())
            assert by_chat.token_ids == by_text.token_ids
            with pytest.raises(RequestError, match="messages\\[0\\].role"):
                client.generate(messages=[{"role": "", "content": "x"}], max_tokens=2)
            with pytest.raises(ValueError, match="exactly one"):
                client.generate("x", messages=messages)


def test_chat_answers_slash_commands_itself_and_sends_the_rest(monkeypatch, capsys):
    """/help lists the commands, an unknown /word says so; neither reaches the model (they used to,
    as user messages). A line with more words is a message, slash or not."""
    from types import SimpleNamespace

    from common.chat_repl import run_chat

    lines = iter(["/help", "/nope", "/usr/bin is a path?", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    sent = []
    backend = SimpleNamespace(name="fake", reply=lambda messages, sampling, show: (sent.append(list(messages)), ("ok", False))[1])
    run_chat(backend, None, {})
    out = capsys.readouterr().out
    assert sent == [[{"role": "user", "content": "/usr/bin is a path?"}]]
    assert out.count("commands: /clear starts over") == 2 and "unknown command /nope" in out


def test_chat_leaves_out_its_oldest_exchanges_once_the_conversation_outgrows_the_context(monkeypatch, capsys):
    """A conversation longer than the context refused every later turn, until /clear: the oldest
    exchanges are now left out (the system message stays), and the user told. A message too long
    alone is refused, and what came before is kept."""
    from types import SimpleNamespace

    from common.chat_repl import run_chat
    from common.tokenizer import check_prompt_length

    lines = iter(["a" * 30, "b" * 30, "c" * 30, "d" * 200, "e", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    sent = []

    def reply(messages, sampling, show):  # a context of 100 characters, the answers 10 each
        check_prompt_length([0] * sum(len(m["content"]) for m in messages), 100, "messages")
        sent.append([m["content"][:1] for m in messages])
        return "x" * 10, False
    run_chat(SimpleNamespace(name="fake", reply=reply), "s", {})
    out = capsys.readouterr().out
    assert sent == [["s", "a"], ["s", "a", "x", "b"], ["s", "b", "x", "c"], ["s", "b", "x", "c", "x", "e"]]
    assert out.count("(the 2 oldest messages were left out") == 1
    assert "error [INVALID_ARGUMENT]: prompt has 201 tokens but the model's maximum context length is 100" in out


def test_a_users_turn_goes_through_the_template_where_the_model_has_one():
    plain, templated = ByteTokenizer(), ByteTokenizer()
    plain.chat_template, templated.chat_template = None, ChatTemplate(DUMMY_CHAT_TEMPLATE)
    assert plain.encode_turn("Hi") == plain.encode("Hi")
    assert bytes(templated.encode_turn("Hi")) == b"<|user|>\nHi\n<|assistant|>\n"


@pytest.mark.parametrize("messages", [False, True], ids=["prompt", "messages"])
def test_a_text_far_past_the_context_is_refused_on_its_heads_tokens(monkeypatch, messages):
    """4 MB of prompt was tokenized whole before being refused: 2.8 s of the router's loop. Its head
    now says it is too long; the error names the field the text came in."""
    from router import prompts as prompts_module

    prompts = Prompts("dummy:nanogpt")  # 1,024 tokens of context, a byte a token
    encoded = []
    real = prompts.tokenizer.encode
    monkeypatch.setattr(prompts.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real(text, **kw))
    text = "ab" * 1_000_000
    with pytest.raises(InvalidArgument) as e:
        if messages:
            prompts.validate(None, [{"role": "user", "content": text}], {"max_tokens": 1})
        else:
            prompts.validate(text, None, {"max_tokens": 1})
    head = (prompts.context + 1) * prompts_module.HEAD_CHARS_PER_TOKEN
    assert encoded == [head] and e.value.param == ("messages" if messages else "prompt")
    assert str(e.value).startswith(f"prompt has more than {head - prompts_module.HEAD_EDGE_TOKENS} tokens but the "
                                   "model's maximum context length is 1024 tokens")
    encoded.clear()  # a text within the head is tokenized once, whole
    assert len(prompts.validate("ab" * 500, None, {"max_tokens": 1})[0]) == 1000 and encoded == [1000]
