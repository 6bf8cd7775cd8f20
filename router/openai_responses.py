"""Our replies (Token, Done) as OpenAI's responses: a choice's text, logprobs, tool calls and
reasoning as they stream (Choice), the usage, and the response and SSE chunk around them
(Envelope). The job (router/openai_api.py) says what to show: echo, logprobs, chat or text.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator

from common import protocol as P
from common.text import TextStream
from router.openai_api import Job

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def token_text(tokenizer, token: int, as_id: bool) -> str:
    return token_shown(tokenizer, token, as_id)[0]


def token_shown(tokenizer, token: int, as_id: bool) -> tuple[str, bytes]:
    """A token as logprobs show it, and its bytes: its text, or OpenAI's "bytes:\\xNN" for one
    that is not whole UTF-8 (a byte-level token inside a character; decoded, several would all be
    U+FFFD)."""
    if as_id or tokenizer is None:
        text = f"token_id:{token}"
        return text, text.encode()
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


class Choice:
    """What one choice has shown so far, and how to show the next tokens."""

    def __init__(self, index: int, job: Job, tokenizer, prompt_ids: list[int], prompt_text: str):
        self.index, self.job, self.tokenizer = index, job, tokenizer
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text  # echo: shown before the completion
        self.started = False  # the first chunk (role, echo) went out
        self.text_len = 0  # characters of the completion streamed
        self.generated = 0  # tokens of the completion streamed
        # completions logprobs: the text before each token, built as it grows, of the prompt (echo)
        # or of the completion, which are decoded apart; and the characters shown before it
        self.offsets: TextStream | None = None
        self.offsets_of_prompt = False
        self.offset_base = 0
        self.done: P.Done | None = None
        self.calls = job.tools.stream() if job.tools is not None else None
        self.thinking = job.reasoning.stream() if job.reasoning is not None else None

    def text_offset(self, token: int, prompt: bool) -> int:
        """Where token's text starts in the choice's text, in characters: a token inside a
        multi-byte character starts where that character does (OpenAI's text_offset; counting
        each token's own decoded length instead drifts past the text at every U+FFFD)."""
        if self.tokenizer is None:
            return 0
        if self.offsets is None or self.offsets_of_prompt != prompt:
            # an echoed prompt's text keeps its special tokens (vLLM's), an output's leaves them out
            self.offsets = TextStream(self.tokenizer, skip_special_tokens=not prompt,
                                      prompt=() if prompt else self.prompt_ids)
            self.offsets_of_prompt = prompt
            self.offset_base = len(self.prompt_text) if self.job.echo and not prompt else 0
        at = self.offset_base + self.offsets.whole_chars()
        self.offsets.add(token)
        return at

    def completion_logprobs(self, token_ids, entries, prompt: tuple | None = None) -> dict:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (the top N and the
        sampled token, as vLLM and OpenAI give), text_offset. prompt: (ids, entries) to put first."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pairs = [(token, entry, True) for token, entry in zip(*prompt)] if prompt else []
        pairs += [(token, entry, False) for token, entry in zip(token_ids, entries or [None] * len(token_ids))]
        as_id = self.job.token_ids_as_text
        for token, entry, of_prompt in pairs:
            text = token_text(self.tokenizer, token, as_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.text_offset(token, of_prompt))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top_ids, top_lps = entry
            out["token_logprobs"].append(_lp(logprob))
            top = {token_text(self.tokenizer, t, as_id): _lp(lp) for t, lp in zip(top_ids, top_lps)}
            top.setdefault(text, _lp(logprob))
            out["top_logprobs"].append(top)
        return out

    def chat_logprobs(self, token_ids, entries) -> dict:
        as_id = self.job.token_ids_as_text

        def item(token, logprob):
            text, raw = token_shown(self.tokenizer, token, as_id)
            return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}

        content = []
        for token, entry in zip(token_ids, entries or ()):
            if entry is not None:
                logprob, top_ids, top_lps = entry
                top = [item(t, lp) for t, lp in zip(top_ids, top_lps)]
                content.append({**item(token, logprob), "top_logprobs": top})
        return {"content": content}

    def logprobs(self, token_ids, entries, prompt_entries=None):
        if self.job.logprobs is None:
            return None
        if self.job.echo_only:
            token_ids, entries = [], []
        if self.job.chat:
            return self.chat_logprobs(token_ids, entries)
        prompt = None
        if self.job.echo and not self.started:
            prompt = (self.prompt_ids, prompt_entries or [None] * len(self.prompt_ids))
        return self.completion_logprobs(token_ids, entries, prompt)

    def chunks(self, msg) -> list[dict]:
        """The choices entries of the chunks for a Token or Done of this choice, in order."""
        out = []
        if self.job.chat and not self.started:
            out.append({"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        if isinstance(msg, P.Token):
            text, finish = "" if self.job.echo_only else msg.text, None
            logprobs = self.logprobs(msg.token_ids, msg.logprobs, msg.prompt_logprobs)
            self.generated += 0 if self.job.echo_only else len(msg.token_ids)
        else:
            self.done = msg = self.shown(msg)
            text, finish = (msg.text or "")[self.text_len:], msg.finish_reason
            logprobs = None
            self.generated = len(msg.token_ids)
        self.text_len += len(text)
        if self.job.echo and not self.started:
            text = self.prompt_text + text
        self.started = True
        if self.job.chat:
            reasoning = ""
            if self.thinking is not None:  # the reasoning, then the answer: calls are the answer's
                reasoning, text = self.thinking.feed(text, finish is not None)
            delta = {"content": text} if text else {}
            if self.calls is not None:
                delta = self.calls.delta(text, finish is not None)
                finish = self.calls_finish(finish, delta)
            if reasoning:
                delta = {**reasoning_fields(reasoning), **delta}
            if not delta and finish is None and not (logprobs and logprobs["content"]):
                return out  # nothing to say yet (text held back for a stop string, a partial character)
            out.append({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        else:
            out.append({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        if finish is not None:
            out[-1]["stop_reason"] = msg.stop_reason
        return out

    def usage(self, entry: dict) -> dict:
        """vLLM's continuous usage stats of one of chunks()'s entries: the choice's prompt and the
        tokens streamed with it (none with a chat's first, which says the role)."""
        generated = 0 if "role" in entry.get("delta", ()) else self.generated
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": generated,
                "total_tokens": len(self.prompt_ids) + generated}

    def calls_finish(self, finish: str | None, shown: dict) -> str | None:
        """OpenAI's finish_reason for an output shown as tool calls: a whole one's is "tool_calls"
        (or "stop" for a function it was told to call)."""
        return self.job.tools.finish_reason if finish == "stop" and "tool_calls" in shown else finish

    def shown(self, done: P.Done) -> P.Done:
        """done as the response shows it: an echo_only choice generated nothing, and stopped at its
        max_tokens, 0."""
        if not self.job.echo_only:
            return done
        return dataclasses.replace(done, finish_reason="length", token_ids=[], text="", logprobs=[], stop_reason=None)

    def final(self, done: P.Done) -> dict:
        """The whole choice of a response that was not streamed."""
        done = self.shown(done)
        text = done.text or ""
        logprobs = self.logprobs(done.token_ids, done.logprobs, done.prompt_logprobs)
        self.done = dataclasses.replace(done, logprobs=None, prompt_logprobs=None)  # shown: usage() needs no more
        if self.job.chat:
            reasoning = None
            if self.job.reasoning is not None:
                reasoning, text = self.job.reasoning.split(text)
            message, finish = {"role": "assistant", "content": text}, done.finish_reason
            if self.job.tools is not None and text is not None:  # (None: all reasoning, cut before the answer)
                message = self.job.tools.message(text)
                finish = self.calls_finish(finish, message)
            if self.job.reasoning is not None:
                message.update(reasoning_fields(reasoning))
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": done.stop_reason}
        return {"index": self.index, "text": (self.prompt_text if self.job.echo else "") + text,
                "logprobs": logprobs, "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}


def reasoning_fields(reasoning: str | None) -> dict:
    """A message's (or delta's) reasoning under both its names: `reasoning`, vLLM's since it followed
    OpenAI's guidance, and `reasoning_content`, DeepSeek's, which SGLang and many clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def usage(job: Job, choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice, and
    OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens the prefill found in its
    prefix cache."""
    firsts = [c.done for c in choices[::job.n] if c.done is not None]
    prompt = sum(len(d.prompt_token_ids) for d in firsts)
    cached = sum(d.timings.get("cached_tokens", 0) for d in firsts)
    completion = sum(len(c.done.token_ids) for c in choices if c.done is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Envelope:
    """The fields every response and chunk of one request shares, serialized once."""

    def __init__(self, job: Job, request_id: str):
        """request_id: what the router's log names the request by (router/http.py), as vLLM's id has it."""
        self.id = f"{'chatcmpl' if job.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if job.chat else "text_completion"
        head = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": job.model}
        self._chunk_head = json.dumps(head)[:-1].encode() + b', "choices": '
        self._no_usage = b', "usage": null' if job.include_usage else b""  # OpenAI's: every chunk but the last

    def response(self, job: Job, choices: list[Choice], entries: list[bytes]) -> Iterator[bytes]:
        """The whole response's JSON, a choice a piece; entries: each choice's final(), in JSON.
        n choices of echoed logprobs can make hundreds of MB, which the caller writes with the
        event loop run in between."""
        head = {"id": self.id, "object": self.object, "created": self.created, "model": job.model}
        yield json.dumps(head)[:-1].encode() + b', "choices": ['
        for i, entry in enumerate(entries):
            yield b", " + entry if i else entry
        yield b'], "usage": ' + json.dumps(usage(job, choices)).encode() + b"}"

    def chunk(self, entries: list[dict], usage_: dict | None = None) -> bytes:
        tail = self._no_usage if usage_ is None else b', "usage": ' + json.dumps(usage_).encode()
        return b"data: " + self._chunk_head + json.dumps(entries).encode() + tail + b"}\n\n"


# ----------------------------------------------------------------------------- vLLM's /tokenize and /detokenize
