"""A request's prompt checked and tokenized, without torch: the router does it for ZeroMQ clients
and its in-process HTTP front, and each API server process (router/api_server.py) for its own
HTTP requests, so both say the same thing about the same bad prompt."""

from __future__ import annotations

from common.chat import TemplateArgs
from common.errors import InvalidArgument
from common.generation_config import with_defaults
from common.model_spec import load_tokenizer, model_config
from common.sampling_params import SamplingParams
from common.text import output_text
from common.tokenizer import check_encoded, check_prompt_length, check_token_ids

# A text over (context + 1) x this many characters has its head tokenized first: text averages 3-5
# characters a token, so a head that already fills the context refuses the whole, and a text whose
# tokens are longer (a run of spaces) is tokenized whole, as any other.
HEAD_CHARS_PER_TOKEN = 16
HEAD_EDGE_TOKENS = 8  # the head's last tokens, which the cut may have split from a longer one


class Prompts:
    def __init__(self, model: str, max_model_len: int | None = None, sampling_defaults: dict | None = None):
        """max_model_len: the served context (vLLM's --max-model-len), prompt and output; at most,
        and by default, the model's. sampling_defaults: what a request leaves out takes
        (common/generation_config.py)."""
        self.model = model
        self.defaults = dict(sampling_defaults or {})
        self.tokenizer = load_tokenizer(model)
        self.model_config = model_config(model)
        self.context = self.model_config.served_context(max_model_len, model)

    def validate(self, prompt: str | list[int], messages: list[dict] | None, sampling: dict | SamplingParams,
                 max_tokens_field: str | None = None, template: TemplateArgs | None = None,
                 add_special_tokens: bool | None = None) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and sampling, or InvalidArgument naming what is wrong. Over HTTP
        a max_tokens the body gave (its field: max_tokens_field) must fit in the context with the
        prompt, as vLLM has it; otherwise (a default, an SDK client's) the engine cuts it to fit.
        template: a chat's, for its template; add_special_tokens: as encode's."""
        if isinstance(sampling, dict):
            sampling = with_defaults(sampling, self.defaults)
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
        params.check_model(self.model_config.vocab_size, self.tokenizer is not None)
        if messages is not None or isinstance(prompt, str):
            if messages is not None and prompt:
                raise InvalidArgument("a request with messages must have an empty prompt; send one or the other",
                                      param="prompt")
            ids = self.encode(prompt, messages, template, within_context=True, add_special_tokens=add_special_tokens)
        else:
            ids = prompt
        limit = self.context
        # before reading ids one by one: a client may send millions
        check_prompt_length(ids, limit, "prompt" if messages is None else "messages")
        if ids is prompt:
            check_token_ids(ids, self.model_config.vocab_size)
        else:
            check_encoded(ids, self.model_config.vocab_size)
        if max_tokens_field is not None and len(ids) + params.max_tokens > limit:
            raise InvalidArgument(f"{max_tokens_field}={params.max_tokens} is too large: the model's maximum context "
                                  f"length is {limit} tokens and the prompt has {len(ids)}; allowed: at most "
                                  f"{limit - len(ids)}", param=max_tokens_field)
        return ids, params

    def encode(self, text: str | None, messages: list[dict] | None, template: TemplateArgs | None = None,
               within_context: bool = False, add_special_tokens: bool | None = None) -> list[int]:
        """The token ids of text, or of messages through the chat template. within_context: a
        text far past the context is refused on its head (_encode_bounded); /tokenize takes any.
        add_special_tokens (vLLM's): the tokenizer's BOS and the like; by default a text's, not a
        chat's (its template writes its own)."""
        param = "prompt" if messages is None else "messages"
        if self.tokenizer is None:
            raise InvalidArgument(f"model {self.model!r} has no tokenizer; send token ids", param=param)
        try:
            special = messages is None if add_special_tokens is None else add_special_tokens
            if messages is not None:
                t = template or TemplateArgs()
                text = self.tokenizer.render_chat(messages, t.add_generation_prompt, t.tools, t.kwargs,
                                                  t.continue_final_message)
            if within_context:
                return self._encode_bounded(text, special, param)
            return self.tokenizer.encode(text, add_special_tokens=special)
        except InvalidArgument as e:
            e.param = e.param or param
            raise

    def _encode_bounded(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """text's ids; a text far longer than the context is refused on its head's tokens, not
        tokenized whole (4 MB held the router's loop 2.8 s, and /health with it)."""
        head = (self.context + 1) * HEAD_CHARS_PER_TOKEN
        if len(text) > head:
            ids = self.tokenizer.encode(text[:head], add_special_tokens=add_special_tokens)
            if len(ids) > self.context + HEAD_EDGE_TOKENS:  # the head's last word may split otherwise whole
                check_prompt_length(ids[:len(ids) - HEAD_EDGE_TOKENS], self.context, param, more_than=True)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def text(self, ids: list[int], skip_special_tokens: bool = True) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens) if self.tokenizer is not None else None

    def output_text(self, ids: list[int], params: SamplingParams, prompt: list[int] = ()) -> str | None:
        """An output's text, as a TextStream of it ends (common/text.py)."""
        if self.tokenizer is None:
            return None
        return output_text(self.tokenizer, ids, params, self.model_config.eos_token_ids, prompt)
