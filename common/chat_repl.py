"""`pdserve chat`: an interactive conversation, streamed as it is generated, with the model
in-process (EngineChat) or behind a router (RouterChat). The whole conversation goes with every
turn, rendered by the model's chat template (in the router, for a cluster).

Ctrl-C stops the current answer and cancels its request (the part already shown stays in the
conversation, as it does in other chat tools); the session goes on. Ctrl-D, /bye or /exit ends
it; /clear starts a new conversation.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable

from common.errors import InvalidArgument, PdserveError
from common.text import TextStream
from common.tokenizer import CONTEXT_FULL

OnText = Callable[[str], None]


class _CtrlC:
    """While generating in-process, Ctrl-C only raises a flag, checked between engine steps: the
    step in flight completes and the engine stays consistent."""

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def check_chat_template(engine) -> None:
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise InvalidArgument(f"model {engine.config.model!r} has no chat template; send a prompt instead")


def chat_prompt_ids(engine, messages: list[dict]) -> list[int]:
    """messages rendered by an in-process engine's chat template, as the router renders them."""
    check_chat_template(engine)
    return engine.tokenizer.encode_chat(messages)


class EngineChat:
    def __init__(self, engine):
        check_chat_template(engine)  # fail now, not at the first message
        self.engine, self.name = engine, engine.config.model

    def reply(self, messages: list[dict], sampling: dict, on_text: OnText) -> tuple[str, bool]:
        """Stream one answer; (its text, whether Ctrl-C stopped it)."""
        from common.sampling_params import SamplingParams

        engine = self.engine
        params = SamplingParams(**sampling)
        prompt = chat_prompt_ids(engine, messages)
        rid = engine.add_request(prompt, params)
        text = TextStream.for_params(engine.tokenizer, params, engine.model_config.eos_token_ids, prompt)
        with _CtrlC() as ctrl_c:
            while not ctrl_c.hit:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    for token in out.new_token_ids:
                        text.add(token)
                    if out.finished:
                        text.final()
                    on_text(text.delta())
                    if out.finished:
                        return text.text, False
        engine.abort_request(rid)
        return text.text[:text.sent], True


class RouterChat:
    def __init__(self, client, name: str):
        self.client, self.name = client, name

    def reply(self, messages: list[dict], sampling: dict, on_text: OnText) -> tuple[str, bool]:
        stream = self.client.stream(messages=messages, **sampling)
        shown = ""
        try:
            for chunk in stream:
                shown += chunk.text
                on_text(chunk.text)
        except KeyboardInterrupt:
            self.client.cancel(stream.request_id)
            for _ in stream:  # the router answers the cancel with Done("cancelled") at once
                pass
            return shown, True
        return shown, False


def show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_chat(backend, system: str | None, sampling: dict) -> None:
    from router.client import RequestError

    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass

    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    show(f"Chatting with {backend.name}. Ctrl-C stops an answer, /clear starts over, Ctrl-D or /bye ends.\n")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            show("\n")
            return
        except KeyboardInterrupt:
            show("\n(Ctrl-D or /bye to end)\n")
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/bye", "/exit", "/quit"):
            return
        if command == "/clear":
            messages = list(start)
            continue
        if command.startswith("/") and len(command.split()) == 1:  # a one-word /line is a command, not a message
            if command not in ("/help", "/?"):
                show(f"unknown command {command}; ")
            show("commands: /clear starts over, /bye (or /exit, /quit, Ctrl-D) ends; Ctrl-C stops an answer\n")
            continue
        sent = messages + [{"role": "user", "content": line}]
        answer = None
        while answer is None:
            try:
                answer, stopped = backend.reply(sent, sampling, show)
            except (PdserveError, RequestError) as e:  # a bad request (too long, no template): say so, go on
                error = f"error [{e.code}]: {getattr(e, 'message', e)}"
                if CONTEXT_FULL in error and len(sent) > len(start) + 1:  # an exchange to leave out
                    del sent[len(start):len(start) + 2]  # the oldest: a user message and its answer
                    continue
                show(error + "\n")
                break
        if answer is None:
            continue
        show(" [stopped]\n" if stopped else "\n")
        left_out = len(messages) + 1 - len(sent)
        if left_out:
            show(f"(the {left_out} oldest messages were left out: with them the conversation is longer than the "
                 "model's context; /clear starts over)\n")
        messages = sent + [{"role": "assistant", "content": answer}]
