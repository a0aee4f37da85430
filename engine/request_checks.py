"""What the engine checks and resolves about a new request before queueing it: the prompt, the
room its output has, tokens generated elsewhere, and facts of the model (eos ids).

Torch-free; every problem is a ValueError naming what is wrong (the Python API's contract).
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

PromptInput = str | list[int]


def tokenize_prompt(
    tokenizer: object, vocab_size: int, prompt: PromptInput
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a text prompt or a list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty string or list of token ids")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary")
    return None, list(prompt)


def resolve_max_tokens(max_model_len: int, prompt_len: int, params: SamplingParams) -> int:
    """max_tokens as asked, capped by the context's room (all of it when not asked)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt is {prompt_len} tokens, longer than the model's context: max_model_len "
            f"is {max_model_len} and at least one token must be generated"
        )
    return room if params.max_tokens is None else min(params.max_tokens, room)


def check_prior(prior: list[int], max_tokens: int, n: int, vocab_size: int) -> None:
    """Output tokens generated before, elsewhere (a migrated or resumed request)."""
    if not prior:
        return
    if n != 1:
        raise ValueError("n must be 1 for a request resumed with prior output tokens")
    if len(prior) >= max_tokens:
        raise ValueError(f"{len(prior)} prior output tokens leave none of max_tokens "
                         f"({max_tokens}) to generate")
    if any(not 0 <= t < vocab_size for t in prior):
        raise ValueError("a prior output token id is outside the vocabulary")


def reads_history(params: SamplingParams) -> bool:
    """Whether sampling a token needs every earlier one on the host (penalties, min_tokens,
    bad words)."""
    return params.min_tokens > 0 or bool(params.bad_words) or (
        params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    ) != (1.0, 0.0, 0.0)


def eos_token_ids(hf_config: object, tokenizer: object) -> frozenset[int]:
    """The model's end-of-sequence ids: config's eos_token_id (int or list) and the tokenizer's."""
    ids: set[int] = set()
    cfg_eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, (list, tuple)):
        ids.update(cfg_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return frozenset(ids)
