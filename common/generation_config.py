"""The sampling a model's makers chose, for served requests that leave it out: vLLM's
`--generation-config` and `--override-generation-config`.

A Hugging Face checkpoint's generation_config.json says how its model is meant to be sampled
(Llama 3 Instruct: temperature 0.6, top_p 0.9; Qwen2.5: also top_k 20 and repetition_penalty
1.05). vLLM serves a request that leaves a field out with the model's value, and so do we: the
router and its API servers fill in temperature, top_p, top_k, min_p and repetition_penalty where
a request (over HTTP or the SDK) gives none, so the same request samples alike on both servers.
As in vLLM, a value equal to transformers' own default (temperature 1.0, top_p 1.0, top_k 50,
repetition_penalty 1.0) is not taken: transformers writes those into every file it saves, and
top_k 50 would cut sampling that vLLM leaves whole. `do_sample` and `max_new_tokens` are not taken
(vLLM takes the second as a cap on max_tokens; we do not cut a request's own max_tokens).

`auto` (the default) reads the model's checkpoint directory; a GGUF file or a dummy model has no
such file, and nothing is filled in. `vllm` (vLLM's name) takes none. A directory reads its
generation_config.json instead. `--override-generation-config '{"temperature": 0.5}'` sets fields
over whichever was read. In-process commands (`generate`, `chat`) sample as their own flags say.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.chat import json_object
from common.errors import InvalidArgument, short_repr

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
SOURCES = "auto (the model's generation_config.json), vllm (none) or a directory holding generation_config.json"


def parse_overrides(text: str | None) -> dict:
    """--override-generation-config's JSON, checked: an object of FIELDS, each a value SamplingParams takes."""
    if not text:
        return {}
    try:
        given = json.loads(text)
    except ValueError:
        given = None
    if not isinstance(given, dict):
        raise InvalidArgument(f"--override-generation-config={short_repr(text)} is invalid; allowed: a JSON object "
                              f"of {', '.join(FIELDS)}")
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise InvalidArgument(f"--override-generation-config sets {unknown[0]!r}; allowed: {', '.join(FIELDS)}")
    return _checked(given, "--override-generation-config")


def sampling_defaults(model: str, source: str = "auto", overrides: dict | None = None) -> dict:
    """The sampling fields a served request of `model` takes where it gives none."""
    from common.model_spec import model_path

    if source == "vllm":
        found = {}
    else:
        if source == "auto":
            path = None if model.startswith("dummy:") else model_path(model)
            folder = path if path is not None and path.is_dir() else None
        else:
            folder = Path(source).expanduser()
            if not (folder / "generation_config.json").is_file():
                raise InvalidArgument(f"--generation-config={source!r} is invalid ({folder / 'generation_config.json'}"
                                      f" is not a file); allowed: {SOURCES}")
        raw = json_object(folder / "generation_config.json") if folder is not None else {}
        found = {k: raw[k] for k in FIELDS if raw.get(k) is not None and raw[k] != TRANSFORMERS_DEFAULTS.get(k)}
        found = _checked(found, str(folder / "generation_config.json") if folder is not None else source)
    return {**found, **(overrides or {})}


def with_defaults(sampling: dict, defaults: dict) -> dict:
    """A request's sampling fields, and defaults' where it gives none (null is none, as over HTTP)."""
    return {**defaults, **{k: v for k, v in sampling.items() if v is not None}}


def _checked(fields: dict, origin: str) -> dict:
    """fields, if SamplingParams takes each (its error names the field and what is allowed)."""
    from common.sampling_params import SamplingParams

    try:
        SamplingParams(**fields)
    except InvalidArgument as e:
        raise InvalidArgument(f"{origin}: {e}") from None
    return dict(fields)

