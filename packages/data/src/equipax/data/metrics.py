"""Metrics an input defines for what is decoded from it and for scores of its examples (SeqIO's
`predict_metric_fns` and `score_metric_fns`), and multiple-choice eval sets.

- A **decode metric** takes the references and the decoded texts, in the same order, and returns
  named numbers: `metric(targets, predictions) -> {name: value}` (SeqIO's argument order). The
  built-ins are `exact_match` and `token_f1` (SQuAD's: lowercased, punctuation and the articles
  a/an/the removed, whitespace collapsed). An input's `decode_metrics()` lists its own;
  `launch decode --split eval` computes them on its outputs.
- A **score metric** takes, for each multiple-choice item, the index of the right choice and the
  model's scores of every choice, and returns named numbers: `metric(answers, scores)`. The
  built-in `choice_accuracy` scores by total log-likelihood (`accuracy`) and by log-likelihood per
  character of the choice (`accuracy_norm`, which does not favour short choices).
- A `MultipleChoiceSet` is the items and their score metrics; `shakespeare_next_line` builds one
  from the Shakespeare plays this package ships (which line comes next in a speech), and
  `launch eval --multiple-choice shakespeare_next_line` scores a job's checkpoints on it.
"""

import dataclasses
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "choice_accuracy",
    "DecodeMetric",
    "exact_match",
    "MULTIPLE_CHOICE_SETS",
    "MultipleChoiceItem",
    "MultipleChoiceSet",
    "normalize_answer",
    "ScoreMetric",
    "shakespeare_next_line",
    "token_f1",
]

# `metric(targets, predictions) -> {name: value}`: references and decoded texts, in one order.
DecodeMetric = Callable[[Sequence[str], Sequence[str]], Mapping[str, float]]
# `metric(answers, scores) -> {name: value}`: per item, the right choice's index and
# `(log_likelihood, characters)` of each choice.
ScoreMetric = Callable[[Sequence[int], Sequence[Sequence[tuple[float, int]]]], Mapping[str, float]]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation and the articles a/an/the, collapse spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _check_pairs(targets: Sequence[str], predictions: Sequence[str]) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions; a metric compares pairs.")


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """`exact_match`: the share of predictions equal to their target after `normalize_answer` (0 for none)."""
    _check_pairs(targets, predictions)
    hits = [normalize_answer(t) == normalize_answer(p) for t, p in zip(targets, predictions)]
    return {"exact_match": float(np.mean(hits)) if hits else 0.0}


def _f1(target: str, prediction: str) -> float:
    want, got = normalize_answer(target).split(), normalize_answer(prediction).split()
    if not want or not got:
        return float(want == got)  # both empty: a match; one empty: none
    common = sum((Counter(want) & Counter(got)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def token_f1(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """`token_f1`: the mean over pairs of the F1 of the normalised words shared (SQuAD's F1)."""
    _check_pairs(targets, predictions)
    scores = [_f1(t, p) for t, p in zip(targets, predictions)]
    return {"token_f1": float(np.mean(scores)) if scores else 0.0}


def choice_accuracy(answers: Sequence[int], scores: Sequence[Sequence[tuple[float, int]]]) -> dict[str, float]:
    """`accuracy` (the right choice has the highest log-likelihood) and `accuracy_norm` (the highest
    log-likelihood per character); ties go to the first choice. 0 for no items."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scored items.")
    total = [int(np.argmax([ll for ll, _ in s])) == a for a, s in zip(answers, scores)]
    norm = [int(np.argmax([ll / max(n, 1) for ll, n in s])) == a for a, s in zip(answers, scores)]
    return {"accuracy": float(np.mean(total)) if total else 0.0, "accuracy_norm": float(np.mean(norm)) if norm else 0.0}


@dataclasses.dataclass(frozen=True)
class MultipleChoiceItem:
    """One question: a context, its possible continuations, and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int

    def __post_init__(self) -> None:
        if len(self.choices) < 2:
            raise ValueError(f"a multiple-choice item needs at least 2 choices, got {len(self.choices)}.")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"answer {self.answer} is not the index of one of the {len(self.choices)} choices.")
        if any(not c for c in self.choices):
            raise ValueError("a choice is empty: each choice must have text to score.")


@dataclasses.dataclass(frozen=True)
class MultipleChoiceSet:
    """A named multiple-choice eval set and the score metrics it is reported with."""

    name: str
    items: tuple[MultipleChoiceItem, ...]
    metrics: tuple[ScoreMetric, ...] = (choice_accuracy,)

    def score(self, scores: Sequence[Sequence[tuple[float, int]]]) -> dict[str, float]:
        """Every metric of the set on the model's `scores` (one list per item, one pair per choice),
        each name prefixed with the set's: `<name>/accuracy`."""
        answers = [item.answer for item in self.items]
        out: dict[str, float] = {}
        for metric in self.metrics:
            out |= {f"{self.name}/{k}": float(v) for k, v in metric(answers, scores).items()}
        return out


def _speech_lines(text: str) -> list[list[str]]:
    """The verse lines of each speech of a play (blocks whose first line is a speaker in capitals)."""
    speeches = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) >= 4 and lines[0].isupper() and not lines[0].startswith(("ACT ", "SCENE ")):
            speeches.append([line for line in lines[1:] if line])
    return speeches


def shakespeare_next_line(
    *, plays: Sequence[str] = ("hamlet", "the-tempest"), num_items: int = 64, num_choices: int = 4, seed: int = 0
) -> MultipleChoiceSet:
    """Which line comes next: two lines of a speech as the context, the speech's next line and
    `num_choices - 1` lines drawn from other speeches of the same plays as the choices (the right
    one at a seeded random place). Built from `load_plays()`; the default plays are the LM
    experiments' held-out `data.validation_plays`, so the models never trained on them.

    **Arguments:**

    - `plays`: play names (`list_plays()`).
    - `num_items`: questions (at most one per speech of four or more lines).
    - `num_choices`: choices per question (>= 2).
    - `seed`: which speeches, distractors and answer positions.
    """
    from equipax.data.sources.shakespeare import list_plays, load_plays

    if num_items < 1 or num_choices < 2:
        raise ValueError(f"num_items must be >= 1 and num_choices >= 2, got {num_items} and {num_choices}.")
    unknown = sorted(set(plays) - set(list_plays()))
    if unknown or not plays:
        raise ValueError(f"unknown play(s) {unknown or '(none given)'}; the plays are {', '.join(list_plays())}.")
    texts = load_plays()
    speeches = [s for p in plays for s in _speech_lines(texts[p])]
    pool = sorted({line for s in speeches for line in s})
    if len(speeches) < num_items:
        raise ValueError(
            f"the plays {list(plays)} have {len(speeches)} speeches of 4+ lines; ask for at most that many."
        )
    rng = np.random.default_rng(seed)
    items = []
    for i in rng.choice(len(speeches), size=num_items, replace=False):
        lines = speeches[int(i)]
        at = int(rng.integers(2, len(lines)))
        right = lines[at]
        distractors: list[str] = []
        while len(distractors) < num_choices - 1:
            line = pool[int(rng.integers(len(pool)))]
            if line != right and line not in distractors:
                distractors.append(line)
        answer = int(rng.integers(num_choices))
        choices = [*distractors[:answer], right, *distractors[answer:]]
        items.append(MultipleChoiceItem("\n".join(lines[at - 2 : at]) + "\n", tuple(choices), answer))
    return MultipleChoiceSet("shakespeare_next_line", tuple(items))


# The built-in sets `launch eval --multiple-choice NAME` knows.
MULTIPLE_CHOICE_SETS: dict[str, Callable[[], MultipleChoiceSet]] = {"shakespeare_next_line": shakespeare_next_line}
