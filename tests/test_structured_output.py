"""Structured outputs (common/structured_output.py): every kind holds the output to its language,
a request's tokens are the same alone, batched, chunked and under async scheduling, a request
resumed from its output so far continues as it would have, and bad specs are refused by name
without harming the engine. Clusters (test_cluster, test_chaos: prefill to decode, migration) and
HTTP (test_http) run them too."""

import dataclasses
import json
import math
import re

import pytest

from common.engine import Engine
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
REGEX = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= ("yes" | "no") "!"'  # GBNF, converted to Lark
SPECS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, {"grammar": GRAMMAR}, {"json_object": True}]


@pytest.fixture(scope="module")
def engine():
    return Engine(model="dummy:nanogpt")


def params(spec, i=0, **kw):
    return SamplingParams(max_tokens=80, temperature=0.0 if i % 2 else 0.9, seed=i, structured_outputs=spec, **kw)


def test_each_kind_holds_the_output_to_its_language(engine):
    prompts = [f"Prompt {i}:" for i in range(2 * len(SPECS))]
    outs = engine.generate(prompts, [params(SPECS[i // 2], i) for i in range(len(prompts))])
    for i, out in enumerate(outs):
        kind, text = next(iter(SPECS[i // 2])), out.text
        if kind == "json_object" and out.finish_reason == "length":  # a random model's object may not close
            continue
        assert out.finish_reason == "stop", (kind, text)
        if kind == "json":
            value = json.loads(text)
            assert set(value) == {"name", "age", "tags"} and len(value["name"]) <= 8 and 0 <= value["age"] <= 150
            assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 3
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        elif kind == "grammar":
            assert text in ("yes!", "no!")
        else:
            assert isinstance(json.loads(text), dict)
    assert any(o.finish_reason == "stop" for o in outs[-2:]), "no JSON object closed: the test checks nothing"
    free = engine.generate(prompts[:2], [params(None, i) for i in range(2)])  # unconstrained: none of that
    assert not any(re.fullmatch(REGEX, o.text) for o in free)


def test_the_same_tokens_alone_batched_chunked_and_async(engine):
    specs = SPECS + [None]
    prompts = [[(5 * i + j) % 250 for j in range(3 + 9 * i)] for i in range(2 * len(specs))]
    sampling = [params(specs[i // 2], i) for i in range(len(prompts))]
    alone = [engine.generate(p, s)[0].token_ids for p, s in zip(prompts, sampling)]
    assert [o.token_ids for o in engine.generate(prompts, sampling)] == alone
    for kw in ({"max_num_batched_tokens": 7, "max_num_seqs": 4}, {"max_num_batched_tokens": 1, "max_num_seqs": 1},
               {"async_scheduling": True}, {"async_scheduling": True, "max_num_batched_tokens": 7, "max_num_seqs": 4}):
        other = Engine(model="dummy:nanogpt", **kw)
        assert [o.token_ids for o in other.generate(prompts, sampling)] == alone, kw


def test_a_request_resumed_from_its_output_continues_as_it_would_have(engine):
    """What a decode worker does with the prefill's token, and a migration with a stream's tokens."""
    prompt = list(b"Resume me:")
    for i, spec in enumerate(SPECS[:2]):
        want = engine.generate(prompt, params(spec, i))[0].token_ids
        k = len(want) // 2
        engine.add_sequence(f"resumed-{i}", prompt + want[:k], len(prompt), params(spec, i), seed=i)
        out = []
        while engine.has_unfinished():
            out += [o for o in engine.step() if o.finished]
        assert out[0].token_ids == want


def after_a_run() -> tuple[list[int], list[SamplingParams]]:
    """A prompt that ends inside </think>, and a choice of CHOICES after that run, after a run that
    never comes, from the first token, and after a run (">>") that the second token ends, a decode's
    (pending on the host when the next step is prepared, under async scheduling); a bias makes '>'
    every token nothing masks."""
    prompt = list(b"<think>\nhmm\n</think")  # the run's last token is the output's first
    after = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"choice": CHOICES},
                           structured_outputs_after=list(b"</think>"), logit_bias={ord(">"): 100.0})
    return prompt, [after, dataclasses.replace(after, max_tokens=12, structured_outputs_after=list(b"</nope>")),
                    dataclasses.replace(after, structured_outputs_after=[]),
                    dataclasses.replace(after, structured_outputs_after=list(b">>"))]


def test_a_structured_output_after_a_run_of_tokens_begins_where_it_ends(engine):
    """structured_outputs_after (a reasoning model's </think>, which the HTTP front sets): the text
    before the run is free and the structured output begins after it, the run begun in the prompt
    or not; live, or resumed after the run (a decode worker, a migration); alone, batched, async."""
    prompt, cases = after_a_run()
    outs = engine.generate([prompt] * len(cases), cases)
    assert outs[0].text[0] == ">" and outs[0].text[1:] in CHOICES and outs[0].finish_reason == "stop"
    assert outs[1].text == ">" * 12  # never begun: free
    assert outs[2].text in CHOICES  # no '>' first: held from its first token
    assert outs[3].text[:2] == ">>" and outs[3].text[2:] in CHOICES
    for case, out, given in ((cases[0], outs[0], 1), (cases[3], outs[3], 1), (cases[3], outs[3], 2)):
        engine.add_sequence("resumed", prompt + out.token_ids[:given], len(prompt), case, seed=0)
        resumed = []
        while engine.has_unfinished():
            resumed += [o for o in engine.step() if o.finished]
        assert resumed[0].token_ids == out.token_ids
    early_end = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs={"regex": "a*"}, min_tokens=4,
                               structured_outputs_after=list(b">>"), logit_bias={ord(">"): 100.0, 257: 50.0})
    sync_early = engine.generate(prompt, early_end)[0]
    # under async scheduling the token after ">>" is sampled while the second '>' is pending on the
    # host (alone: batched beside a masked request, the step waits for it): masked on the device
    # where that token is the run's end
    for kw in ({"async_scheduling": True}, {"async_scheduling": True, "max_num_batched_tokens": 7, "max_num_seqs": 4}):
        other = Engine(model="dummy:nanogpt", **kw)
        assert [o.token_ids for o in other.generate([prompt] * len(cases), cases)] == [o.token_ids for o in outs], kw
        assert [other.generate(prompt, case)[0].token_ids for case in cases] == [o.token_ids for o in outs], kw
        begun = other.generate(prompt, dataclasses.replace(cases[3], logprobs=5))[0]  # the mask before the logprobs
        offered = {t for t, lp in zip(*begun.logprobs[2][1:]) if lp > -math.inf}
        assert offered == {ord(c[0]) for c in CHOICES}, kw
        # min_tokens holds EOS off the free text, not where the grammar begins: it says where the output ends
        early = other.generate(prompt, early_end)[0]
        assert (early.text, early.finish_reason) == (">>", "stop") == (sync_early.text, sync_early.finish_reason), kw
    for bad in ("x", [-1], list(range(17))):
        with pytest.raises(InvalidArgument, match="structured_outputs_after"):
            dataclasses.replace(cases[0], structured_outputs_after=bad)
    with pytest.raises(InvalidArgument, match="without structured_outputs"):
        SamplingParams(structured_outputs_after=[1])


def test_bad_specs_are_refused_by_name_and_the_engine_serves_on(engine):
    for spec, text in [({"regex": "a("}, "structured_outputs.regex does not compile"),
                       ({"json": "{"}, "structured_outputs.json is not JSON"),
                       ({"choice": []}, "a non-empty list of non-empty strings"),
                       ({"json": {"type": "bogus"}}, "Invalid type: bogus"),
                       ({"regex": "a", "choice": ["b"]}, "2 kinds given"),
                       ({"grammar": "x"}, "structured_outputs.grammar does not compile: Failed to convert the grammar "
                                          "from GBNF to Lark: Expected ::= at line 1, 'x' ^ ''; allowed: a Lark or GBNF"),
                       ({"json_schema": {}}, "unknown key 'json_schema'"),
                       ("{}", "allowed: a map with exactly one of"),
                       ({"regex": "(" * 2000 + "a" + ")" * 2000}, "structured_outputs.regex does not compile"),
                       ({"choice": [f"option {i}" for i in range(8000)]},
                        "is 118890 bytes as JSON; allowed: at most 65536"),
                       # once an HTTP 500 and, over ZeroMQ, no answer at all
                       ({"json": "[" * 5000 + "]" * 5000}, "allowed: nesting at most a few hundred levels deep"),
                       ({"choice": ["\ud800"]}, "allowed: text without lone surrogates"),
                       ({"json": {"type": "integer", "minimum": 10**30}}, "allowed: numbers that fit 64 bits"),
                       # under 64 KiB, but its message to a worker was refused there, 3 times over 180 s
                       ({"json": {"type": "object", "properties": {str(i): {} for i in range(4200)}}},
                        "structured_outputs.json holds a map of 4200 entries; allowed: at most 4096")]:
        with pytest.raises(InvalidArgument, match=re.escape(text)) as e:
            SamplingParams.from_dict({"structured_outputs": spec})
        assert e.value.param == "structured_outputs" and len(str(e.value)) < 600  # no spec quoted whole
    # output that its grammar cannot have produced (a resumed request's, from the network)
    with pytest.raises(InvalidArgument, match="output so far does not match its structured_outputs"):
        engine.add_sequence("bad", list(b"x: ") + list(b"[1"), 3, params({"json": SCHEMA}), seed=0)
    assert "bad" not in engine.requests
    assert engine.generate("ok", params({"choice": CHOICES}))[0].text in CHOICES


def test_bench_structured_prints_a_table_and_json(capsys):
    from bench.structured import KINDS, run_structured_bench

    result = run_structured_bench({"model": "dummy:nanogpt"}, batch=3, max_tokens=6, rounds=1, seed=0)
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(result)) and "mask % of free step" in "\n".join(out)
    assert set(result["kinds"]) == set(KINDS) and result["kinds"]["free"]["vs_free"] == 1.0
    for kind, k in result["kinds"].items():
        assert 0 < k["tokens"] <= 3 * 6 and k["full_steps"] >= 1
        assert (k["mask_ms_per_step"] is None) == (kind == "free")


def test_a_tokenizer_llguidance_cannot_read_refuses_structured_requests_only():
    from common.structured_output import Grammars
    from common.tokenizer import ByteTokenizer

    class Unreadable(ByteTokenizer):
        def token_bytes(self, token):
            raise RuntimeError("no bytes for you")

    grammars = Grammars(Unreadable(), 258, [257])
    grammars.warm_up()  # fails in its thread; the reason is kept for each request
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="llguidance cannot read its tokenizer .*no bytes for you"):
            grammars.matcher({"choice": ["a"]})


def test_logprobs_never_offer_a_token_the_grammar_ruled_out(engine):
    """As vLLM's: the mask comes before the logprobs, and penalties after (raw logprobs otherwise)."""
    spec = {"choice": CHOICES}
    out = engine.generate("x", SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, structured_outputs=spec,
                                              presence_penalty=1.5))[0]
    assert out.text in CHOICES
    first_token_logprob, top_ids, top_logprobs = out.logprobs[0]
    allowed = {engine.tokenizer.encode(c)[0] for c in CHOICES}
    offered = {t for t, lp in zip(top_ids, top_logprobs) if lp > -math.inf}
    assert offered == allowed and first_token_logprob > -math.inf
    assert abs(sum(math.exp(lp) for lp in top_logprobs) - 1) < 1e-4  # the allowed tokens' softmax
    free = engine.generate("x", SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    assert set(free.logprobs[0][1]) != allowed


def test_an_object_that_lists_its_properties_takes_no_others_unless_it_says_so(engine):
    """As vLLM's default backend reads a schema (and OpenAI's strict mode requires): left open, a
    small model wrote {"a": "Bob", "b": 30, "c": "Bob", "d": ... until max_tokens."""
    person = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string"}, "properties": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    encode = engine.tokenizer.encode
    for text in ('{"a": "x", "c"', '{"a": "x", "properties": {"x": 1, "y"'):
        with pytest.raises(InvalidArgument, match="does not match"):
            engine.grammars.matcher({"json": person}, encode(text))
    engine.grammars.matcher({"json": person}, encode('{"a": "x", "properties": {"x": 1}}'))
    engine.grammars.matcher({"json": person | {"additionalProperties": True}}, encode('{"a": "x", "c": 1'))
    either = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    engine.grammars.matcher({"json": either}, encode('{"a": 1, "b": 2}'))  # not each part closed to the other's
    assert engine.grammars.matcher({"json": {"type": "object"}}, encode('{"any": 1')) is not None


def test_required_tool_calls_keep_each_tools_references(engine):
    """tool_choice "required" holds the output to a list of calls, each tool's parameters nested
    inside: a Pydantic schema's "#/$defs/..." then pointed nowhere (a 400), and a recursive "#" at
    the list itself (calls accepted as a tree's children)."""
    import jsonschema

    from router.openai_api import parse_chat

    loc = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    weather = {"$defs": {"Loc": loc}, "type": "object", "additionalProperties": False, "required": ["loc"],
               "properties": {"loc": {"$ref": "#/$defs/Loc"}}}
    tree = {"type": "object", "additionalProperties": False, "required": ["v"],
            "properties": {"v": {"enum": [1, 2]}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
             for name, schema in (("weather", weather), ("tree", tree))]
    job = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"},
                     "dummy:nanogpt", 1024)
    spec = job.params.structured_outputs
    good = '[{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2}]}}, ' \
           '{"name": "weather", "parameters": {"loc": {"city": "Oslo"}}}]'
    engine.grammars.matcher(spec, engine.tokenizer.encode(good))
    with pytest.raises(InvalidArgument, match="does not match"):
        engine.grammars.matcher(spec, engine.tokenizer.encode('[{"name": "tree", "parameters": {"v": 1, "kids": '
                                                              '[{"name": "tree"'))
    outs = engine.generate([[1, 2, 3]] * 4, [SamplingParams(max_tokens=400, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                            structured_outputs=spec) for i in range(4)])
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        for c in json.loads(out.text):
            jsonschema.validate(c["parameters"], {"weather": weather, "tree": tree}[c["name"]])


def test_a_spec_compiles_once_for_all_its_choices_and_each_request_has_its_own_state(engine, monkeypatch):
    """n=20 choices of a 64 KiB spec compiled 20 times: 2 s of a worker's loop, and the router took
    the worker for dead. Now once, in the router's check and in the worker, and each request gets a
    copy that moves alone."""
    import llguidance

    from common import structured_output

    compiled, validated = [], []
    real_matcher, real_validate = llguidance.LLMatcher, llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(structured_output.Grammars, "_compiled", lambda self, spec, real=structured_output.Grammars
                        ._compiled: compiled.append(1) or real(self, spec))
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar",
                        staticmethod(lambda g: validated.append(1) or real_validate(g)))
    spec = {"choice": [f"c{i:05d}" for i in range(6400)]}  # (a spec no other test makes: none is cached yet)
    for i in range(20):
        engine.add_sequence(f"n{i}", [1, 2], 2, SamplingParams.from_dict(  # each as it comes from the wire
            {"max_tokens": 8, "structured_outputs": json.loads(json.dumps(spec))}), seed=i)
    seqs = [engine.requests[f"n{i}"] for i in range(20)]
    assert (len(compiled), len(validated)) == (1, 1) and real_matcher is llguidance.LLMatcher
    seqs[0].matcher.consume_token(list(b"c")[0])
    assert seqs[1].matcher.compute_ff_tokens() != seqs[0].matcher.compute_ff_tokens()  # copies, not one state
    for seq in seqs:
        engine.abort_request(seq.request_id)


def test_a_grammar_that_allows_nothing_is_refused_and_one_llguidance_gives_up_on_is_logged(engine, caplog):
    """A schema that only refers to itself compiles, but allows no text: it came back 200 with empty
    output. One whose items outgrow llguidance ended 'abort' with nothing in any log."""
    with pytest.raises(InvalidArgument, match="structured_outputs cannot be followed from its start"):
        only_itself = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
        engine.add_sequence("self", [1, 2], 2, params({"json": only_itself}), seed=0)
    assert "self" not in engine.requests
    recursive = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                      "required": ["x"]}}}
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        out = engine.generate("deep", params({"json": recursive}))[0]
    assert out.finish_reason == "abort" and "llguidance could not follow it" in caplog.text
