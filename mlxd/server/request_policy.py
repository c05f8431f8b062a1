"""The request policy: what a text request gets for what it leaves out, decided once.

Every text API (OpenAI chat and completions, Responses, Anthropic, Ollama) builds its
``GenerationRequest`` from the client's values alone, with ``sampling_params`` and
``stop_list`` below; ``TextSession.open`` then calls ``apply_serving_defaults`` once,
for every API: a missing ``max_tokens`` becomes the registry entry's
``defaults.max_tokens``, else ``--max-tokens``. The engine enforces only the context,
with the one overflow rule of ``generation/output_length.py`` (None: the rest of the
context; more than the room the prompt leaves: capped to it).
"""

from __future__ import annotations

from typing import Any

from mlxd.config import ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.generation.params import GenerationRequest, SamplingParams
from mlxd.models.spec import ServingDefaults

SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers (MLX's PRNG key)


def pick(*values: Any) -> Any:
    """First value that is not None."""
    for v in values:
        if v is not None:
            return v
    return None


def sampling_params(*, temperature: float | None, top_p: float | None, top_k: int | None,
                    min_p: float | None, seed: int | None, repetition_penalty: float | None,
                    presence_penalty: float | None, frequency_penalty: float | None,
                    logit_bias: dict[str, float] | None,
                    defaults: ServingDefaults) -> SamplingParams:
    """Request values, else the registry entry's serving defaults, else OpenAI's."""
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {seed}.", param="seed")
    return SamplingParams(
        temperature=float(pick(temperature, defaults.temperature, 1.0)),
        top_p=float(pick(top_p, defaults.top_p, 1.0)),
        top_k=int(pick(top_k, defaults.top_k, 0) or 0) if pick(top_k, defaults.top_k, 0) != -1 else 0,
        min_p=float(pick(min_p, defaults.min_p, 0.0)),
        seed=seed,
        repetition_penalty=pick(repetition_penalty, defaults.repetition_penalty),
        presence_penalty=float(presence_penalty or 0.0),
        frequency_penalty=float(frequency_penalty or 0.0),
        logit_bias=_bias_ids(logit_bias) or None,
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
    """Fill the output limit ``request`` left out: the model's registry default, else the
    server's ``--max-tokens`` (neither: None, the rest of the context)."""
    if request.max_tokens is None:
        request.max_tokens = defaults.max_tokens or config.max_tokens
