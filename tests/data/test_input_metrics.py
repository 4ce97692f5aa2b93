"""Metrics an input defines (SeqIO's predict/score metric functions): exact match and token F1
against hand-worked SQuAD-style cases, multiple-choice accuracy by total and per-character
log-likelihood, the built-in Shakespeare next-line set built from the packaged plays, and what an
input and its wrappers report."""

import pytest

from equipax.data.metrics import (
    MultipleChoiceItem,
    MultipleChoiceSet,
    choice_accuracy,
    exact_match,
    normalize_answer,
    shakespeare_next_line,
    token_f1,
)


def test_normalisation_drops_case_punctuation_and_articles():
    assert normalize_answer("  The Cat,  sat on A mat! ") == "cat sat on mat"
    assert normalize_answer("An apple; the end.") == "apple end"


def test_exact_match_and_token_f1_on_worked_cases():
    targets = ["the cat sat", "Paris", "to be or not to be", ""]
    predictions = ["Cat sat.", "London", "to be", ""]
    assert exact_match(targets, predictions) == {"exact_match": 0.5}  # cases 1 and 4
    # F1 per pair: [cat sat] vs [cat sat] = 1; no overlap = 0; [to be or not to be] vs [to be]:
    # common 2, precision 2/2, recall 2/6 -> 2*1*(1/3)/(4/3) = 0.5; both empty = 1.
    assert token_f1(targets, predictions)["token_f1"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert token_f1(["a b b"], ["b b b"])["token_f1"] == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    with pytest.raises(ValueError, match="2 targets but 1 predictions"):
        exact_match(["a", "b"], ["a"])


def test_choice_accuracy_by_total_and_per_character_log_likelihood():
    answers = [0, 1, 1]
    scores = [
        [(-1.0, 10), (-2.0, 10)],  # right by both
        [(-3.0, 3), (-4.0, 20)],  # total prefers the short wrong one; per character the long right one
        [(-5.0, 5), (-5.0, 5)],  # a tie goes to the first choice: wrong
    ]
    assert choice_accuracy(answers, scores) == {"accuracy": pytest.approx(1 / 3), "accuracy_norm": pytest.approx(2 / 3)}


def test_the_shakespeare_set_asks_for_the_real_next_line_of_a_held_out_speech():
    from equipax.data import load_plays

    mc = shakespeare_next_line(num_items=16, seed=3)
    assert mc.name == "shakespeare_next_line" and len(mc.items) == 16
    texts = "\n".join(load_plays()[p] for p in ("hamlet", "the-tempest"))
    lines = [line.strip() for line in texts.splitlines()]
    answers = set()
    for item in mc.items:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
        first, second = item.context.rstrip("\n").split("\n")
        right = item.choices[item.answer]
        # The right choice is the line after the context's two lines in the play itself.
        at = [i for i in range(len(lines) - 2) if (lines[i], lines[i + 1], lines[i + 2]) == (first, second, right)]
        assert at, (item.context, right)
        answers.add(item.answer)
    assert len(answers) > 1  # the right one's place varies
    assert shakespeare_next_line(num_items=16, seed=3) == mc  # a pure function of its arguments
    assert mc.score([[(0.0, 1)] * 4 for _ in mc.items])["shakespeare_next_line/accuracy"] == pytest.approx(
        sum(i.answer == 0 for i in mc.items) / 16
    )


def test_bad_sets_and_items_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown play"):
        shakespeare_next_line(plays=("no-such-play",))
    with pytest.raises(ValueError, match="at least 2 choices"):
        MultipleChoiceItem("ctx", ("only",), 0)
    with pytest.raises(ValueError, match="answer 2 is not the index"):
        MultipleChoiceItem("ctx", ("a", "b"), 2)


def test_an_input_reports_its_metrics_through_wrappers():
    import numpy as np

    from equipax.data import MappedInput, TokenWindowInput, make_eval_input

    class WithSet(TokenWindowInput):
        def multiple_choice(self):
            return MultipleChoiceSet("tiny", (MultipleChoiceItem("a", ("b", "c"), 1),))

        def decode_metrics(self):
            return (*super().decode_metrics(), lambda targets, predictions: {"n": float(len(targets))})

    base = WithSet(np.arange(200) % 7, seq_len=4, batch_size=2)
    assert TokenWindowInput(np.arange(200) % 7, seq_len=4, batch_size=2).multiple_choice() is None
    for wrapped in (MappedInput(base, lambda b: b), make_eval_input(base, reset_for_eval=False, num_batches=2)):
        assert wrapped.multiple_choice().name == "tiny"
        metrics = wrapped.decode_metrics()
        assert metrics[:2] == (exact_match, token_f1) and metrics[2](["x"], ["y"]) == {"n": 1.0}
