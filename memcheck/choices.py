"""Choice points: the data-dependent answers that change what a training step allocates.

A meta tensor has no values, so where model code branches on the data, memcheck must
answer for it (``memcheck.rules.data_dependent``). Most answers have one worst case
(``nonzero`` selects every element). Some do not: which branch costs more depends on the
model, the target and its kernels. transformers skips the attention mask when it is all
ones, and on CUDA, SDPA with grouped-query attention in fp32 and no mask then takes the
math kernel, which needs more than the memory-efficient kernel the padded mask gets. Those
answers are **choice points**, each with the answers a real batch can produce:

* ``padding``: the batch contains padding (every ``*attention_mask`` of the batch is
  unknown, and checks on it answer "not all ones": ``padding``), or it contains none
  (every ``*attention_mask`` is all ones, so checks on it read their true value:
  ``no-padding``).
* ``routing``: how a mixture-of-experts layer that loops over its experts splits its
  ``tokens * top_k`` routed rows: the first experts looped over take every token
  (``routing=worst``, the costliest split measured) or every expert gets an even share
  (``routing=balanced``).

``estimate`` traces the step with each point's first answer, and records the points whose
answer mattered (``Choices.consult``: a check on the mask that would have read otherwise,
a routing split taken). It then traces the step again with each combination of the other
answers of those points, and reports the larger peak, which answer produced it and what
the others gave. ``Job.assume`` pins answers (``--assume no-padding,routing=balanced``):
a pinned point is traced with that answer only.

Example:
    >>> parse_assume("no-padding, routing=balanced")
    ('no-padding', 'routing=balanced')
    >>> Choices(("no-padding",)).answer(PADDING)
    'no-padding'
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from memcheck.errors import UsageError, closest

PADDING, NO_PADDING = "padding", "no-padding"  # the point and its first answer share a name
ROUTING = "routing"
ROUTING_WORST, ROUTING_BALANCED = "routing=worst", "routing=balanced"


@dataclass(frozen=True)
class ChoicePoint:
    """One data-dependent question and the answers a real batch can give; the first is traced first."""

    name: str
    answers: tuple[str, ...]
    words: tuple[str, ...]  # each answer as the report says it


POINTS: tuple[ChoicePoint, ...] = (
    ChoicePoint(PADDING, (PADDING, NO_PADDING),
                ("with padding (attention masks not all ones)", "without padding (attention masks all ones)")),
    ChoicePoint(ROUTING, (ROUTING_WORST, ROUTING_BALANCED),
                ("MoE routing: first experts take every token", "MoE routing: balanced across experts")),
)
_POINT = {p.name: p for p in POINTS}
_OF_ANSWER = {a: p for p in POINTS for a in p.answers}
ANSWERS = tuple(_OF_ANSWER)


def point_of(answer: str) -> ChoicePoint:
    return _OF_ANSWER[answer]


def words(answer: str) -> str:
    """How the report says ``answer``."""
    p = _OF_ANSWER[answer]
    return p.words[p.answers.index(answer)]


def parse_assume(value) -> tuple[str, ...]:
    """``Job.assume``: pinned answers, from ``"no-padding,routing=balanced"`` or a list, in
    ``POINTS`` order; () pins nothing.

    Raises:
        UsageError: an unknown answer (with the closest), or two answers for one point.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise UsageError(f"must be a string or a list of answers ({', '.join(ANSWERS)}), got {value!r}")
    chosen: dict[str, str] = {}
    for item in items:
        text = item.strip().lower() if isinstance(item, str) else item
        if text not in _OF_ANSWER:
            raise UsageError(f"has no answer {item!r}{closest(str(text), ANSWERS)}; allowed: {', '.join(ANSWERS)}")
        name = _OF_ANSWER[text].name
        if name in chosen and chosen[name] != text:
            raise UsageError(f"gives two answers for {name}: {chosen[name]} and {text}")
        chosen[name] = text
    return tuple(chosen[p.name] for p in POINTS if p.name in chosen)


def attention_masks(batch) -> list:
    """The batch's attention masks: the tensors of a mapping batch under a key ending in
    ``attention_mask`` (``attention_mask``, ``decoder_attention_mask``), which the ``padding``
    point is about."""
    if not isinstance(batch, Mapping):
        return []
    return [v for k, v in batch.items() if isinstance(k, str) and k.endswith("attention_mask")
            and hasattr(v, "dtype")]


class Choices:
    """The answers one trace gives at the choice points, and the points whose answer mattered.

    ``pinned``: the job's ``assume`` (never traced otherwise); ``forced``: the answers of an
    alternative trace.
    """

    def __init__(self, pinned: tuple[str, ...] = (), forced: tuple[str, ...] = ()):
        self.pinned = {_OF_ANSWER[a].name for a in pinned}
        self._answers = {p.name: p.answers[0] for p in POINTS}
        for a in (*pinned, *forced):
            self._answers[_OF_ANSWER[a].name] = a
        self.consulted: dict[str, set] = {}  # points whose answer mattered -> where: {(step, phase), ...}

    def answer(self, name: str) -> str:
        return self._answers[name]

    def consult(self, name: str, where: tuple | None = None) -> None:
        """Note that the answer at ``name`` decided something in this trace, at ``where``
        (the tracer's ``(step, phase)``)."""
        self.consulted.setdefault(name, set()).add(where)

    def in_forwards_only(self, name: str) -> bool:
        """Whether every check at ``name`` was in a training forward (or loss), the first in step 1's."""
        wheres = self.consulted.get(name, set())
        phases = {getattr(w[1], "value", None) for w in wheres if w is not None}
        return (bool(wheres) and None not in wheres and phases <= {"forward", "loss"}
                and any(w[0] == 0 for w in wheres))

    def taken(self, names) -> tuple[str, ...]:
        """This trace's answers at the points ``names``, in ``POINTS`` order."""
        return tuple(self._answers[p.name] for p in POINTS if p.name in names)

    def alternatives(self) -> list[tuple[str, ...]]:
        """Every other combination of answers at the consulted, unpinned points."""
        names = [p.name for p in POINTS if p.name in self.consulted and p.name not in self.pinned]
        combos = itertools.product(*(_POINT[n].answers for n in names))
        mine = tuple(self._answers[n] for n in names)
        return [c for c in combos if c != mine]
