"""Speculative decoding by n-gram lookup (vLLM's `--speculative-config '{"method": "ngram", ...}'`).

A decoding request whose last few tokens occurred before in its prompt or output is given, as a
draft, the tokens that followed them there. The step feeds its newest token and the draft as one
chunk and samples a token at every row; row j's token is the one a plain decode would sample at
that position, because the noise is keyed by (seed, position) (common/sampling.py). The draft's
tokens are kept while they equal what was sampled before them, and the first that does not is
replaced by the sampled one: each step yields 1 to len(draft) + 1 tokens.

So the output is not only distributed as without speculation, as rejection sampling promises:
it is the same tokens, greedy or seeded, wherever the logits of a chunk's rows are the bits of a
decode's (batch-invariant kernels: the default on CUDA, `--batch-invariant` on a CPU; elsewhere
as after a migration, which re-prefills). Requests whose logits the host adjusts (penalties,
bias, unmet min_tokens) or masks (structured outputs) decode without drafts.
"""

from __future__ import annotations

import array
import json
from dataclasses import dataclass

from common.errors import InvalidArgument

MAX_SPECULATIVE_TOKENS = 16
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # the longest draft
    prompt_lookup_max: int  # the longest suffix looked up, tried first
    prompt_lookup_min: int  # the shortest

    @classmethod
    def parse(cls, spec: str | dict | None) -> "SpeculativeConfig | None":
        """vLLM's speculative_config (a dict, or its JSON): method "ngram", num_speculative_tokens,
        and prompt_lookup_max/min (either defaults to the other; both to 5, as vLLM's do)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise InvalidArgument(f"speculative_config={spec!r} is not JSON ({e})") from None
        if not isinstance(spec, dict):
            raise InvalidArgument(f"speculative_config={spec!r}; allowed: an object such as "
                                  '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise InvalidArgument(f"speculative_config has {unknown}; allowed keys: {list(_KEYS)}")
        if spec.get("method") != "ngram":
            raise InvalidArgument(f"speculative_config method={spec.get('method')!r}; allowed: 'ngram' (drafts "
                                  "from the request's own tokens; no draft model)")
        k = spec.get("num_speculative_tokens")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            top = MAX_SPECULATIVE_TOKENS if name == "num_speculative_tokens" else 64
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise InvalidArgument(f"speculative_config {name}={value!r}; allowed: an integer in 1..{top}")
        if lo > hi:
            raise InvalidArgument(f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}")
        return cls(k, hi, lo)

    def as_dict(self) -> dict:
        return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}


def ngram_draft(tokens: array.array, max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The up to max_tokens tokens that followed the latest earlier occurrence of tokens' last n
    tokens, trying n from max_n down to min_n; [] if none occurs. tokens are searched as an
    array's bytes, so the scan runs in C (bytes.rfind), at an occurrence per probe."""
    size = tokens.itemsize
    data = tokens.tobytes()
    count = len(tokens)
    for n in range(min(max_n, count - 1), min_n - 1, -1):
        pattern = data[(count - n) * size:]
        end = len(data) - size  # an occurrence ending before the suffix's last token: not the suffix
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % size == 0:
                start = at // size + n
                return tokens[start:start + max_tokens].tolist()
            end = at + len(pattern) - 1  # straddles two tokens: look further back
    return []


class Drafter:
    """Drafts for the scheduler: which requests may speculate, and their n-gram drafts."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # vLLM's spec_decode counters

    @staticmethod
    def eligible(seq) -> bool:
        """Its logits reach the sampler as the model gives them (none adjusted or masked: a draft's
        later rows would need the drafted tokens counted), and it decodes here."""
        return not seq.prefill_only and not seq.adjusted_now

    def propose(self, seq, max_tokens: int) -> list[int]:
        cfg = self.config
        tokens = array.array("q", seq.settled_tokens())  # a copy: it grows by the newest token
        tokens.append(seq.token_ids[-1])
        return ngram_draft(tokens, min(max_tokens, cfg.num_speculative_tokens), cfg.prompt_lookup_min,
                           cfg.prompt_lookup_max)

    def counted(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    def counters(self) -> list[int]:
        return [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens]
