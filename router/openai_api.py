"""OpenAI's API in pdserve's terms: request bodies of /v1/completions and /v1/chat/completions
checked and turned into jobs (prompts, SamplingParams, how many choices, what to show), and our
errors in OpenAI's shape; router/openai_responses.py turns our replies (Token, Done) into its
response, chunk and logprob shapes. No HTTP here: router/http.py serves these.

Checking is strict, as the rest of pdserve: a field of the wrong type, out of range, or unknown
gets a 400 naming it and what is allowed. Fields of OpenAI's API that we do not implement
(suffix, audio, ...) are accepted at their neutral value, which is what client libraries send by
default, and refused otherwise: silently ignoring them would change results.

response_format json_object and json_schema hold the output to JSON (common/structured_output.py);
so does a chat's tool_choice "required" or naming a function, shown as tool_calls (router/tool_calls.py);
under "auto" the calls are found in the text by the server's --tool-call-parser (router/tool_parsers.py).

Extensions, as vLLM has them: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, include_stop_str_in_output, structured_outputs (json, json_object, regex, choice,
grammar) and return_tokens_as_token_ids ("token_id:N" in logprobs, where token texts could collide).

n > 1 makes n requests whose seeds are seed + i (vLLM's rule; common/sampling_params.py choice_seed): our
noise is keyed by (seed, position), so n copies under one seed would be n equal answers. Without a
seed each choice draws its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common import structured_output
from common.chat import TemplateArgs, check_template_kwargs
from common.errors import InvalidArgument, short_repr
from common.generation_config import with_defaults
from common.sampling_params import MAX_LOGPROBS, SamplingParams, choice_seed
from router import tool_calls
from router.reasoning import PARSERS as REASONING_PARSERS, ReasoningParser
from router.tool_calls import Tools

# our codes -> HTTP status, and OpenAI's error type for each status
STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "FORBIDDEN": 403, "NOT_FOUND": 404, "METHOD_NOT_ALLOWED": 405,
          "REQUEST_TIMEOUT": 408, "TOO_LARGE": 413, "OVERLOADED": 429, "UNAVAILABLE": 503, "TIMEOUT": 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error", 504: "timeout_error"}
RETRY_AFTER_S = 1  # what a 429 or a 503 asks the client to wait


class ApiError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status = STATUS.get(code, 500)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


BOOL = (lambda v: isinstance(v, bool), "true or false")
STRING = (lambda v: isinstance(v, str), "a string")
# Fields we take as given to SamplingParams, which checks them.
SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
            "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
            "min_tokens", "logit_bias")
# Known fields we do not implement: accepted at the value that means "off".
NEUTRAL = {
    "suffix": ((None, ""), "null"),
    "tools": ((None, []), "null or [] (no tool calling)"), "functions": ((None, []), "null or []"),
    "tool_choice": ((None, "none", "auto"), '"none" (no tool calling)'),
    "function_call": ((None, "none", "auto"), '"none"'),
    "parallel_tool_calls": ((None, True, False), "true or false"),
    "store": ((None, False), "false"), "service_tier": ((None, "auto", "default"), '"auto"'),
    "modalities": ((None, ["text"]), '["text"]'),
    "reasoning_effort": ((None,), "null (not a reasoning model)"), "verbosity": ((None,), "null"),
    "prediction": ((None,), "null"), "audio": ((None,), "null"), "web_search_options": ((None,), "null"),
    # vLLM's extensions, at what we do
    "skip_special_tokens": ((None, True), "true"), "spaces_between_special_tokens": ((None, True), "true"),
    "echo": ((None, False), "false (in chat)"),
    # ... and those a client that fills in vLLM's whole request sends at their defaults
    "use_beam_search": ((None, False), "false"), "length_penalty": ((None, 1, 1.0), "1.0"),
    "priority": ((None, 0), "0"), "truncate_prompt_tokens": ((None,), "null"),
    "prompt_logprobs": ((None,), "null (echo with logprobs scores a completion's prompt)"),
    "allowed_token_ids": ((None,), "null"), "bad_words": ((None, []), "null or []"),
    "include_reasoning": ((None, True), "true"), "cache_salt": ((None,), "null"),
    "return_token_ids": ((None, False), "false"), "kv_transfer_params": ((None,), "null"),
    "vllm_xargs": ((None,), "null"), "logits_processors": ((None,), "null"), "mm_processor_kwargs": ((None,), "null"),
    "thinking_token_budget": ((None,), "null"),
}
CHAT_ONLY_NEUTRAL = {"echo"}
# what a chat says of its template beside the messages (TemplateArgs)
TEMPLATE_FIELDS = {"chat_template_kwargs", "documents", "add_generation_prompt", "continue_final_message"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}  # a completion's are neutral; a chat's: tool_calls.parse
COMPLETION_NEUTRAL = {k: v for k, v in NEUTRAL.items() if k not in CHAT_ONLY_NEUTRAL}
CHAT_NEUTRAL = {k: v for k, v in NEUTRAL.items() if k not in TOOL_FIELDS}
# OpenAI's obfuscation pads chunks against side channels: ours are not padded, asked or not
STREAM_NEUTRAL = {"include_obfuscation": ((None, True, False), "true or false")}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", *STREAM_NEUTRAL}
IGNORED = ("user", "prompt_cache_key", "safety_identifier")  # strings that ask nothing of the output
COMMON_FIELDS = {"model", "n", "stream", "stream_options", "return_tokens_as_token_ids", "metadata", *IGNORED,
                 *SAMPLING, "response_format", "structured_outputs", "add_special_tokens",
                 "request_id"}  # vLLM's, as X-Request-Id (router/http.py)
COMPLETION_FIELDS = COMMON_FIELDS | set(COMPLETION_NEUTRAL) | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = (COMMON_FIELDS | set(CHAT_NEUTRAL) | TOOL_FIELDS
               | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", *TEMPLATE_FIELDS})
# Integer fields take a float that is an integer (2.0, as a client that computed it sends), as vLLM's
# models do; 2.5, "2" and true stay refused
INTEGERS = ("n", "max_tokens", "seed", "top_k", "min_tokens")
COMPLETION_INTEGERS = (*INTEGERS, "logprobs", "best_of")
CHAT_INTEGERS = (*INTEGERS, "max_completion_tokens", "top_logprobs")


@dataclass
class Job:
    """One HTTP request: its prompts (or messages), sampling and n, and what its response shows."""
    chat: bool
    model: str
    prompts: list  # text or token ids each; chat: [""]
    messages: list | None
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool  # stream_options': the last chunk's usage
    echo: bool
    logprobs: int | None  # alternatives shown per token, or None: no logprobs
    token_ids_as_text: bool
    max_tokens_field: str | None = None  # the body's max_tokens or max_completion_tokens, if it gave one
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone, as vLLM gives it
    tools: Tools | None = None  # a chat's tools: how its output is shown (Tools.message, Tools.stream)
    template: TemplateArgs | None = None  # a chat's: its tools, template variables, where its prompt ends
    reasoning: ReasoningParser | None = None  # a chat's output split into reasoning_content and content
    think_first: bool = False  # its structured output begins when its thinking ends (router/http.py _prepare)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: each chunk's choice's usage so far
    # vLLM's add_special_tokens: None, what each endpoint does (a prompt's text gets them, a chat's
    # template writes its own)
    add_special_tokens: bool | None = None

    def choice_params(self, index: int) -> SamplingParams:
        """Choice index's sampling (choices are prompt-major: prompt index * n + j)."""
        j = index % self.n
        if self.n == 1 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=choice_seed(self.params.seed, j))


def _get(body: dict, name: str, rule, default=None):
    value = body.get(name)
    if value is None:
        return default
    check, allowed = rule
    if not check(value):
        raise InvalidArgument(f"{name}={short_repr(value)} is invalid; allowed: {allowed}", param=name)
    return value


def _check_fields(body, allowed: set[str], neutral: dict | None = None):
    """Only allowed fields, and those of `neutral` (as NEUTRAL) at their neutral values."""
    if not isinstance(body, dict):
        kind = {type(None): "null", list: "an array", str: "a string", bool: "a boolean", int: "a number",
                float: "a number"}.get(type(body), type(body).__name__)
        raise InvalidArgument(f"the body is {kind}; allowed: a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidArgument(f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}", param=unknown[0])
    neutral = neutral or {}
    for name in sorted(set(neutral) & set(body)):
        values, allowed_text = neutral[name]
        if not any(body[name] == v and type(body[name]) is type(v) for v in values):
            raise InvalidArgument(f"{name}={short_repr(body[name])} is not supported; allowed: {allowed_text}",
                                  param=name)


def _integral(body: dict, names: tuple[str, ...]) -> dict:
    """body, its fields `names` that hold an integral float as ints."""
    ints = {k: int(body[k]) for k in names if isinstance(body.get(k), float) and body[k].is_integer()}
    return {**body, **ints} if ints else body


def _sampling(body: dict, max_tokens: int, defaults: dict, **extra) -> dict:
    """The SamplingParams fields of a body (SamplingParams checks them): max_tokens, and the
    served model's defaults (common/generation_config.py), where it gives none."""
    return {"max_tokens": max_tokens, **with_defaults({k: body[k] for k in SAMPLING if k in body}, defaults),
            "structured_outputs": _structured(body), **extra}


RESPONSE_FORMATS = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                    '{"name": 1-64 letters, digits, _ or -, "schema": {...}}}')


def _structured(body: dict) -> dict | None:
    """The structured output a body asks for: vLLM's structured_outputs as given, or OpenAI's
    response_format in its terms (json_schema's `strict` asks for what we always do)."""
    fmt, spec = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and spec is not None and fmt != {"type": "text"}:
        raise InvalidArgument("response_format and structured_outputs are both given; allowed: one of them",
                              param="structured_outputs")
    if spec is not None or fmt is None:
        return spec
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return structured_output.check({"json_object": True}, "response_format")
    inner = fmt.get("json_schema") if kind == "json_schema" and set(fmt) == {"type", "json_schema"} else None
    if not (isinstance(inner, dict) and isinstance(inner.get("schema"), dict) and isinstance(inner.get("name"), str)
            and tool_calls.NAME.fullmatch(inner["name"])  # OpenAI and vLLM require one
            and isinstance(inner.get("strict", False), (bool, type(None)))
            and set(inner) <= {"name", "schema", "strict", "description"}):
        raise InvalidArgument(f"response_format={short_repr(fmt)} is invalid; allowed: {RESPONSE_FORMATS}",
                              param="response_format")
    return structured_output.check({"json": inner["schema"]}, "response_format", "response_format.json_schema.schema")


Served = str | tuple[str, ...]  # the names the model is served by (--served-model-name), the first shown


def served_names(served_model_names: tuple[str, ...], model: str) -> tuple[str, ...]:
    """What requests may call the model: each --served-model-name (the first is shown in
    responses and metrics), else its --model."""
    return tuple(served_model_names) or (model,)


def check_model(model, served: Served) -> None:
    names = (served,) if isinstance(served, str) else served
    if model not in names:
        shown = repr(names[0]) if len(names) == 1 else ", ".join(map(repr, names))
        raise ApiError("NOT_FOUND", f"the model {short_repr(model)} does not exist; served: {shown}", "model")


def requested_model(body: dict, served: Served) -> str:
    """The model a body names, one of those served; by default the first."""
    model = _get(body, "model", STRING, served if isinstance(served, str) else served[0])
    check_model(model, served)
    return model


def _job(body: dict, served_model: Served, chat: bool, prompts: list, messages: list | None, sampling: dict,
         echo: bool, logprobs: int | None) -> Job:
    """Check the fields both endpoints share, and make the Job."""
    model = requested_model(body, served_model)
    stream = _get(body, "stream", BOOL, False)
    options = _get(body, "stream_options", (lambda v: isinstance(v, dict), "an object"))
    include_usage = continuous_usage = False
    if options is not None:
        if not stream and options:  # (an empty one asks nothing: vLLM takes it with stream=false)
            raise InvalidArgument(f"stream_options={short_repr(options)} with stream=false; allowed: "
                                  "stream_options only with stream=true", param="stream_options")
        try:
            _check_fields(options, STREAM_OPTIONS, STREAM_NEUTRAL)
            include_usage = _get(options, "include_usage", BOOL, True)  # vLLM's default, once stream_options is given
            continuous = _get(options, "continuous_usage_stats", BOOL, False)
        except InvalidArgument as e:
            raise InvalidArgument(f"stream_options: {e}", param="stream_options") from None
        continuous_usage = include_usage and continuous  # as vLLM: only with the last chunk's
    for name in IGNORED:
        _get(body, name, STRING)
    _get(body, "metadata", (lambda v: isinstance(v, dict), "an object"))
    n = _get(body, "n", (lambda v: _is_int(v) and v >= 1, "an integer >= 1"), 1)
    as_ids = _get(body, "return_tokens_as_token_ids", BOOL, False)
    try:
        params = SamplingParams(**sampling)
    except InvalidArgument as e:
        if e.param == "max_tokens" and body.get("max_completion_tokens") is not None:  # chat's newer name
            raise InvalidArgument(str(e).replace("max_tokens", "max_completion_tokens", 1),
                                  param="max_completion_tokens") from None
        raise
    given = next((f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None)
    return Job(chat, model, prompts, messages, params, n, stream, include_usage, echo, logprobs, as_ids, given,
               continuous_usage=continuous_usage, add_special_tokens=_get(body, "add_special_tokens", BOOL))


def _is_documents(v) -> bool:
    return isinstance(v, list) and all(isinstance(d, dict) and all(isinstance(x, str) for x in d.values()) for d in v)


DOCUMENTS = (_is_documents, 'a list of objects of strings ({"title": ..., "text": ...})')
LOGPROBS = (lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")


def parse_completion(body, served_model: Served, defaults: dict | None = None) -> Job:
    _check_fields(body, COMPLETION_FIELDS, COMPLETION_NEUTRAL)  # a completion's echo is its own
    body = _integral(body, COMPLETION_INTEGERS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidArgument(f"prompt={short_repr(prompt)} is invalid; allowed: a string, a list of token ids, "
                              "or a non-empty list of either", param="prompt")
    n = body.get("n") or 1
    _get(body, "best_of", (lambda v: _is_int(v) and v == n, f"null or n ({n}): no best-of selection"))
    echo = _get(body, "echo", BOOL, False)
    logprobs = _get(body, "logprobs", LOGPROBS)
    sampling = _sampling(body, 16, defaults or {}, logprobs=logprobs,  # OpenAI's 16
                         prompt_logprobs=logprobs if echo else None)
    # max_tokens 0 with echo scores a prompt (its logprobs, as evaluation harnesses ask): vLLM runs
    # it with one token and shows none, and so do we
    echo_only = _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if echo_only and not echo:
        raise InvalidArgument("max_tokens=0 is invalid without echo; allowed: an integer in [1, 2**31 - 1], or 0 "
                              "with echo=true (the prompt alone)", param="max_tokens")
    if echo_only:
        sampling["max_tokens"] = 1
    job = _job(body, served_model, False, prompts, None, sampling, echo, logprobs)
    return dataclasses.replace(job, echo_only=echo_only)


@dataclass(frozen=True)
class OutputParsers:
    """How the served model writes what a chat's response shows apart from its text: the server's
    --tool-call-parser (router/tool_parsers.py: tool_choice "auto") and --reasoning-parser
    (router/reasoning.py: reasoning_content)."""
    tool_call: str | None = None
    reasoning: str | None = None

    def argv(self) -> list[str]:
        """Their flags, for another process that serves the same API."""
        return ((["--tool-call-parser", self.tool_call] if self.tool_call else [])
                + (["--reasoning-parser", self.reasoning] if self.reasoning else []))


def parse_chat(body, served_model: Served, context: int, parsers: OutputParsers = OutputParsers(),
               defaults: dict | None = None) -> Job:
    _check_fields(body, CHAT_FIELDS, CHAT_NEUTRAL)
    body = _integral(body, CHAT_INTEGERS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(f"messages={short_repr(messages)} is invalid; allowed: a non-empty list of "
                              '{"role": ..., "content": ...} objects', param="messages")
    want = _get(body, "logprobs", BOOL, False)
    top = _get(body, "top_logprobs", LOGPROBS)
    if top and not want:  # (0 is what some clients send by default: as vLLM, allowed)
        raise InvalidArgument(f"top_logprobs={top} with logprobs=false; allowed: top_logprobs only with "
                              "logprobs=true (or top_logprobs=0)", param="top_logprobs")
    logprobs = (top or 0) if want else None
    sampling = _sampling(body, context, defaults or {}, logprobs=logprobs)  # by default to the context's end (vLLM)
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    tools = tool_calls.parse(body, _get(body, "parallel_tool_calls", BOOL, True), parsers.tool_call)
    if tools is not None and tools.calls:
        if sampling["structured_outputs"] is not None:
            given = "response_format" if body.get("response_format") is not None else "structured_outputs"
            raise InvalidArgument(f"tool_choice={short_repr(body['tool_choice'])} and {given} both say what the output "
                                  "is; allowed: one of them", param="tool_choice")
        # each tool's parameters were checked alone, by name; this is the list of calls they make together
        sampling["structured_outputs"] = structured_output.check(tools.structured_outputs(), "tools",
                                                                  "the tools' parameters (as one schema)")
    job = _job(body, served_model, True, [""], messages, sampling, False, logprobs)
    template = _template_args(body, tools.tools if tools else None)
    reasoning = None if parsers.reasoning is None else REASONING_PARSERS[parsers.reasoning]
    # held to JSON by response_format or a forced call (not by a grammar of its own, which may hold
    # <think>), the output thinks first (router/reasoning.py thinking_end)
    think_first = reasoning is not None and sampling["structured_outputs"] is not None and body.get(
        "structured_outputs") is None
    return dataclasses.replace(job, tools=tools, template=template, reasoning=reasoning, think_first=think_first)


def _template_args(body: dict, tools: list[dict] | None = None) -> TemplateArgs:
    """A chat's TemplateArgs from its body's TEMPLATE_FIELDS."""
    kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    documents = _get(body, "documents", DOCUMENTS)  # vLLM's: for a RAG template (Command R's, Granite's)
    if documents is not None:
        kwargs = {**(kwargs or {}), "documents": documents}
    return TemplateArgs(tools, kwargs, _get(body, "add_generation_prompt", BOOL, True),
                        _get(body, "continue_final_message", BOOL, False))


# ----------------------------------------------------------------------------- tokenize


@dataclass(frozen=True)
class Tokenize:
    """A /tokenize body: a prompt's text, or a chat's messages with its TemplateArgs; vLLM's
    add_special_tokens (None: as the endpoints do) and return_token_strs (each token's vocabulary
    string beside its id)."""
    prompt: str | None
    messages: list | None
    template: TemplateArgs
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


def parse_tokenize(body, served_model: Served) -> Tokenize:
    _check_fields(body, {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", *TEMPLATE_FIELDS})
    requested_model(body, served_model)
    messages = body.get("messages")
    prompt = _get(body, "prompt", STRING)
    if (prompt is None) == (messages is None):
        raise InvalidArgument("give one of prompt (a string) or messages", param="prompt")
    if messages is not None and (not isinstance(messages, list) or not messages):
        raise InvalidArgument(f"messages={short_repr(messages)} is invalid; allowed: a non-empty list of "
                              '{"role": ..., "content": ...} objects', param="messages")
    return Tokenize(prompt, messages, _template_args(body), _get(body, "add_special_tokens", BOOL),
                    _get(body, "return_token_strs", BOOL, False))


def parse_detokenize(body, served_model: Served, vocab_size: int) -> list[int]:
    """The token ids of a /detokenize body: {"tokens": [ids]}."""
    _check_fields(body, {"model", "tokens"})
    requested_model(body, served_model)
    tokens = body.get("tokens")
    if not _is_token_ids(tokens) or not all(0 <= t < vocab_size for t in tokens):
        raise InvalidArgument(f"tokens={short_repr(tokens)} is invalid; allowed: a list of token ids in "
                              f"[0, {vocab_size})", param="tokens")
    return tokens
