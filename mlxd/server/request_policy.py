"""The request policy: what a text request gets for what it leaves out, decided once.

Every text API (OpenAI chat and completions, Responses, Anthropic, Ollama) builds its
``GenerationRequest`` from the client's values alone: ``sampling_choices`` (checked, with
None for each value the client left out), ``stop_list``, the client's
``chat_template_kwargs`` and ``max_tokens`` (None when not given). ``TextSession.open``
then calls ``apply_serving_defaults`` once, for every API, with the defaults of the
registry entry it leased (so an alias, a glob alias or a LoRA adapter's name gets its
model's): each sampling value left out becomes the entry's default, else OpenAI's
(temperature 1, top_p 1, top_k and min_p off; ``top_k`` -1 turns it off); the entry's
``chat_template_kwargs`` go under the client's; a missing ``max_tokens`` becomes the
entry's ``defaults.max_tokens``, else ``--max-tokens``. The engine enforces only the
context, with the one overflow rule of ``generation/output_length.py`` (None: the rest
of the context; more than the room the prompt leaves: capped to it).
"""

from __future__ import annotations

from typing import Any

from mlxd.config import ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.generation.params import GenerationRequest, SamplingChoices, SamplingParams
from mlxd.models.spec import ServingDefaults

SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers (MLX's PRNG key)


def pick(*values: Any) -> Any:
    """First value that is not None."""
    for v in values:
        if v is not None:
            return v
    return None


def sampling_choices(*, temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, min_p: float | None = None,
                     seed: int | None = None, repetition_penalty: float | None = None,
                     presence_penalty: float | None = None,
                     frequency_penalty: float | None = None,
                     logit_bias: dict[str, float] | None = None) -> SamplingChoices:
    """The client's sampling values, checked (a bad ``seed`` or ``logit_bias`` key is a
    400); what it left out stays None until ``apply_serving_defaults``."""
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {seed}.", param="seed")
    return SamplingChoices(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                           seed=seed, repetition_penalty=repetition_penalty,
                           presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty,
                           logit_bias=_bias_ids(logit_bias) or None)


def resolve_sampling(choices: SamplingChoices, defaults: ServingDefaults) -> SamplingParams:
    """The client's values, else the registry entry's serving defaults, else OpenAI's."""
    top_k = pick(choices.top_k, defaults.top_k, 0)
    return SamplingParams(
        temperature=float(pick(choices.temperature, defaults.temperature, 1.0)),
        top_p=float(pick(choices.top_p, defaults.top_p, 1.0)),
        top_k=0 if top_k == -1 else int(top_k),
        min_p=float(pick(choices.min_p, defaults.min_p, 0.0)),
        seed=choices.seed,
        repetition_penalty=pick(choices.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=float(choices.presence_penalty or 0.0),
        frequency_penalty=float(choices.frequency_penalty or 0.0),
        logit_bias=choices.logit_bias,
    )


def _bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias`` keyed by token id; the engine checks the ids against its vocabulary."""
    out: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}.",
                                 param="logit_bias") from None
    return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in items if s]


def apply_serving_defaults(request: GenerationRequest, defaults: ServingDefaults,
                           config: ServerConfig) -> None:
    """Fill in what ``request`` left out, from the leased model's registry ``defaults``:
    the sampling values (into ``request.sampling``), the chat template's kwargs (the
    client's over the entry's) and the output limit (the entry's, else the server's
    ``--max-tokens``; neither: None, the rest of the context)."""
    if request.sampling_choices is not None:
        request.sampling = resolve_sampling(request.sampling_choices, defaults)
    request.chat_template_kwargs = {**defaults.chat_template_kwargs,
                                    **request.chat_template_kwargs}
    if request.max_tokens is None:
        request.max_tokens = defaults.max_tokens or config.max_tokens
