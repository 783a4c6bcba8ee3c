"""`Sampling`: how a token is drawn from the model's distribution, one record for `zerolm sample`'s flags,
training's samples (the `sample:` section extends it) and `zerolm serve`'s requests.

The order is Hugging Face's (`generate`'s logits processors, then its warpers): the repetition penalty
(Keskar et al. 2019: a seen token's logit divided by the penalty when positive, multiplied when negative),
then greedy at temperature 0, else the temperature, top-k, top-p (nucleus) and typical sampling (Meister et
al. 2022: the tokens whose information is nearest the distribution's entropy, until their probability
reaches typical_p)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError, field_validator

from zerolm.config.section import Section, problem
from zerolm.core.errors import UsageError


class Sampling(Section):
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    top_p: float = 1.0  # ... among the fewest whose probability reaches top_p; 1: all
    typical_p: float = 1.0  # ... among the most typical whose probability reaches typical_p; 1: all
    repetition_penalty: float = 1.0  # > 1 makes a token already in the text less likely; 1: none
    seed: int | None = None  # the draws' seed; None: the caller's (a run's train.seed; 0 elsewhere)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        return _check(value, value >= 0, "must be >= 0 (0: greedy)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        return _check(value, value >= 0, "must be >= 0 (0: no cut)")

    @field_validator("top_p", "typical_p")
    @classmethod
    def _probability(cls, value: float) -> float:
        return _check(value, 0 < value <= 1, "must be in (0, 1] (1: no cut)")

    @field_validator("repetition_penalty")
    @classmethod
    def _penalty(cls, value: float) -> float:
        return _check(value, value > 0, "must be > 0 (1: no penalty)")


def _check(value, ok: bool, rule: str):
    if not ok:
        raise ValueError(f"{value} {rule}")
    return value


class SamplingError(UsageError):
    """A sampling setting out of its range, named as the caller spells it (`field`: the setting's own name)."""

    def __init__(self, field: str, spelled: str, message: str):
        super().__init__(f"{spelled}: {message}")
        self.field = field


def checked(values: dict[str, Any], spelled: Callable[[str], str] = str) -> Sampling:
    """A `Sampling` from a command's flags or a request's fields; a bad one named by `spelled(field)`."""
    try:
        return Sampling(**values)
    except ValidationError as error:
        field, message = problem(error)
        raise SamplingError(field, spelled(field), message) from None
