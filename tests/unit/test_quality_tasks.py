"""The quality harness's tasks: exact lengths, reproducible, the asked-for fact at its depth; its arithmetic."""

import math
import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from benchmarks.common import policy_options
from benchmarks.quality import (
    compared_cells,
    family_rows,
    policy_grid,
    prompts_needed,
    reliable_cells,
    request_budget,
    servable,
    summary_rows,
    wilson,
)
from benchmarks.tasks import (
    ACTIVITIES,
    ANSWER_TOKENS,
    COLORS,
    CWE_RARE_FREQ,
    FREQUENT_EVERY,
    FREQUENT_TAIL,
    NAMES,
    OTHERS,
    RULER_TASKS,
    SURNAMES,
    TASKS,
    TaskBuilder,
    TaskItem,
    answer_tokens,
    essay_words,
    is_hit,
    score,
)


@pytest.fixture(scope="module")
def builder(model_path):
    return TaskBuilder(AutoTokenizer.from_pretrained(str(model_path)))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1000, 4000])
def test_prompts_have_the_exact_length_and_are_reproducible(builder, task, length):
    item = builder.build(task, length, 0.5, seed=0)
    assert len(item.ids) == length
    assert builder.build(task, length, 0.5, seed=0) == item
    assert builder.build(task, length, 0.5, seed=1).ids != item.ids


@pytest.mark.parametrize("task", ["passkey", "niah", "multikey", "kv"])
def test_the_answer_sits_at_its_depth(builder, task):
    """The answer's first occurrence moves from the start to the end of the context with the depth."""
    places = []
    for depth in (0.0, 0.5, 1.0):
        item = builder.build(task, 2000, depth, seed=0)
        text = builder.tokenizer.decode(item.ids)
        assert text.count(item.answer) >= 1
        places.append(text.index(item.answer) / len(text))
    assert places[0] < 0.1 and 0.4 < places[1] < 0.6 and places[2] > 0.85


def test_multikey_asks_for_one_of_two_distinct_needles(builder):
    item = builder.build("multikey", 2000, 0.3, seed=0)
    text = builder.tokenizer.decode(item.ids)
    assert text.count("The special magic number for") == 2 + 1  # two needles and the answer's stem
    assert text.count(item.answer) == 1


def test_twostage_answer_is_the_color_of_the_sum(builder):
    item = builder.build("twostage", 2000, 0.5, seed=3)
    text = builder.tokenizer.decode(item.ids)
    left, right = text.rsplit("The equation is ", 1)[1].split(" = ?")[0].split(" + ")
    key = int(left) + int(right)
    assert f" {key}: {item.answer}," in text


def test_twostage_counts_only_the_first_color_named():
    item = TaskItem("twostage", 10, 0.5, [], "teal")
    assert is_hit(item, " 18, the color is teal.")
    assert not is_hit(item, " 18, the color is red or teal")
    assert not is_hit(item, " 18.")
    assert set(COLORS) >= {"teal", "red"}


def test_frequent_repeats_one_name_outside_the_last_quarter_and_four_others_once(builder):
    item = builder.build("frequent", 2000, 0.5, seed=0)
    text = builder.tokenizer.decode(item.ids)
    story = text[: text.index("\n\nQuestion:")]
    sentence = re.compile(rf" ((?:{'|'.join(NAMES)}) (?:{'|'.join(SURNAMES)})) ({'|'.join(ACTIVITIES)})\.")

    def filler_tokens(part: str) -> int:
        return len(builder.encode(sentence.sub("", part)))

    named = Counter(name for name, _ in sentence.findall(story))
    assert named[item.answer] == 2000 // FREQUENT_EVERY
    assert sorted(named.values()) == [1] * OTHERS + [2000 // FREQUENT_EVERY]
    # After the main person's last sentence: the filler's last quarter at least (less a sentence's slack).
    after = story[story.rindex(f" {item.answer} ") :]
    assert filler_tokens(after) >= FREQUENT_TAIL * filler_tokens(story) - 40


def test_frequent_counts_only_the_first_person_named_and_asks_their_surname():
    item = TaskItem("frequent", 10, 0.5, [], "Nora Whitfield")
    assert is_hit(item, " Nora Whitfield.")
    assert not is_hit(item, " Nora.")
    assert not is_hit(item, " Nora Ashworth, Nora Whitfield")
    assert not is_hit(item, " Tina Ashworth, then Nora Whitfield")
    assert not is_hit(item, " not specified.")


def test_request_budget_reads_tokens_and_compression_ratios():
    assert request_budget("256", 4000) == 256
    assert request_budget("0.9", 4000) == 400
    assert request_budget("0.75", 1000) == 250


def test_omnikv_ratio_is_one_minus_the_papers_mem_share():
    """The paper's Mem% (§5): full-attention layers read f = (2|L| + L0) / layers = (2 * 3 + 2) / 30 of the
    cache, so at 30% Mem each sparse layer reads (0.3 - f) / (1 - f) of the prompt."""
    dense = 8 / 30
    assert request_budget("0.7", 1000, "omnikv", 30) == math.ceil((0.3 - dense) / (1 - dense) * 1000) == 46
    assert request_budget("0.5", 4000, "omnikv:dense_layers=0", 30) == math.ceil((0.5 - 6 / 30) / (1 - 6 / 30) * 4000)


def test_policy_specs_carry_typed_options_and_their_own_budget():
    assert policy_grid(["adamix:mix=1,alpha=0.5@0.7", "keydiff"], ["0.5", "0.75"]) == [
        ("adamix:mix=1,alpha=0.5", ["0.7"]),
        ("keydiff", ["0.5", "0.75"]),
    ]
    assert policy_options("adamix:mix=1,alpha=0.5") == {"kv_policy": "adamix", "kv_mix": 1, "kv_alpha": 0.5}
    assert policy_options("d2o:merge=false") == {"kv_policy": "d2o", "kv_merge": False}
    assert policy_options("omnikv:filter_layers=2+14+17") == {"kv_policy": "omnikv", "kv_filter_layers": (2, 14, 17)}


def test_summary_averages_only_where_the_full_cache_is_reliable():
    rows = [
        {"policy": "none", "budget": None, "ratio": None, "task": "niah", "context": 1000, "accuracy": 1.0},
        {"policy": "none", "budget": None, "ratio": None, "task": "niah", "context": 2000, "accuracy": 0.4},
        {"policy": "snapkv", "budget": 128, "ratio": None, "task": "niah", "context": 1000, "accuracy": 0.5},
        {"policy": "snapkv", "budget": 128, "ratio": None, "task": "niah", "context": 2000, "accuracy": 0.0},
    ]
    reliable = reliable_cells(rows)
    assert reliable == {("niah", 1000)}
    summary = {r["policy"]: r["niah"] for r in summary_rows(rows, reliable)}
    assert summary == {"none": 1.0, "snapkv": 0.5}


def test_the_full_cache_is_compared_only_where_the_policies_ran():
    rows = [
        {"policy": "none", "budget": None, "ratio": None, "task": "niah", "context": 1000, "accuracy": 1.0},
        {"policy": "none", "budget": None, "ratio": None, "task": "niah", "context": 8000, "accuracy": 0.0},
        {"policy": "none", "budget": None, "ratio": None, "task": "passkey", "context": 8000, "accuracy": 1.0},
        {"policy": "snapkv", "budget": None, "ratio": 0.75, "task": "niah", "context": 1000, "accuracy": 0.5},
    ]
    assert compared_cells(rows) == {("niah", 1000)}
    summary = {r["policy"]: (r["niah"], r["mean"]) for r in summary_rows(rows, compared_cells(rows))}
    assert summary == {"none": (1.0, 1.0), "snapkv": (0.5, 0.5)}


def test_pairs_a_policy_cannot_serve_are_left_out_with_the_reason(model_path):
    grid, left_out = servable([("snapkv", ["0.9"]), ("omnikv", ["0.5", "0.9"])], [1000], str(model_path))
    assert grid == [("snapkv", ["0.9"]), ("omnikv", ["0.5"])]
    assert len(left_out) == 1 and left_out[0].startswith("omnikv@0.9: Mem% 10% is below")


@pytest.mark.parametrize("task", RULER_TASKS)
def test_ruler_families_state_every_answer_in_the_context(builder, task):
    item = builder.build(task, 2000, 0.3, seed=2)
    context = builder.tokenizer.decode(item.ids).rsplit("\n\n", 1)[0]  # the question cut off
    assert len(set(item.answers)) == len(item.answers) >= 3
    assert all(re.search(rf"\b{answer}\b", context) for answer in item.answers)
    assert answer_tokens(task) > ANSWER_TOKENS


def test_multivalue_has_four_numbers_for_one_word_a_quarter_apart(builder):
    item = builder.build("multivalue", 4000, 0.1, seed=0)
    text = builder.tokenizer.decode(item.ids)
    needles = re.findall(r"One of the special magic numbers for (\w+) is: (\d+)\.", text)
    assert len({word for word, _ in needles}) == 1 and [n for _, n in needles] == list(item.answers)
    places = [text.index(number) / len(text) for number in item.answers]
    assert places == sorted(places) and all(0.15 < b - a < 0.35 for a, b in zip(places, places[1:]))


def test_multiquery_asks_for_four_words_each_with_its_own_number(builder):
    item = builder.build("multiquery", 2000, 0.6, seed=0)
    text = builder.tokenizer.decode(item.ids)
    needles = dict(re.findall(r"One of the special magic numbers for (\w+) is: (\d+)\.", text))
    question = text.rsplit("What are all the special magic numbers for ", 1)[1]
    asked = re.findall(r"\w+", question.split(" mentioned")[0])
    asked.remove("and")
    assert len(needles) == 4 and [needles[word] for word in asked] == list(item.answers)


def test_variables_is_one_chain_of_four_hops_in_order_after_an_answered_example(builder):
    item = builder.build("variables", 2000, 0.5, seed=4)
    example, task = builder.tokenizer.decode(item.ids).split("following text.\n\n")[1:]
    statements = re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", task)
    value = task.rsplit("assigned the value ", 1)[1].split(",")[0]
    assert [name for name, _ in statements] == list(item.answers)
    assert [source for _, source in statements] == [value, *item.answers[:-1]]
    shown = [name for name, _ in re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", example)]
    assert f"they are: {', '.join(shown)}.\n\nMemorize" in example and not set(shown) & set(item.answers)


def test_common_words_recur_more_often_than_every_other_word(builder):
    item = builder.build("common_words", 2000, 0.5, seed=0)
    listing = re.findall(r"\d+\. (\w+)", builder.tokenizer.decode(item.ids))
    counts = Counter(listing)
    assert {word for word, _ in counts.most_common(len(item.answers))} == set(item.answers)
    rare = min(counts[word] for word in item.answers)
    assert rare > max(c for word, c in counts.items() if word not in item.answers) == CWE_RARE_FREQ
    assert listing and all(word in essay_words() for word in counts)


def test_frequent_words_answers_are_the_three_most_frequent_with_no_tie(builder):
    item = builder.build("frequent_words", 4000, 0.5, seed=1)
    text = builder.tokenizer.decode(item.ids)
    words = text.split("\n\n")[1].split()
    ranked = Counter(words).most_common(4)
    assert [word for word, _ in ranked[:3]] == list(item.answers)
    assert ranked[2][1] > ranked[3][1]


def test_ruler_score_is_the_share_of_answers_named_as_whole_words():
    item = TaskItem("multivalue", 10, 0.5, [], "1234567, 7654321", ("1234567", "7654321"))
    assert score(item, " 1234567 and 7654321.") == 1
    assert score(item, " 1234567, 765432") == 0.5
    assert score(item, " 91234567") == 0
    assert score(TaskItem("niah", 10, 0.5, [], "42"), " 42.") == 1


def test_wilson_interval_and_the_prompts_a_five_point_interval_needs():
    low, high = wilson(0.9, 100)
    assert low == pytest.approx(0.826, abs=1e-3) and high == pytest.approx(0.945, abs=1e-3)
    assert wilson(1.0, 20)[1] == 1.0 and wilson(1.0, 20)[0] == pytest.approx(0.839, abs=1e-3)
    assert (
        prompts_needed(0.5) == 381 and prompts_needed(0.9) == 141 and prompts_needed(1.0) == prompts_needed(0.0) == 35
    )


def test_family_rows_pool_the_solved_contexts_and_compare_with_the_full_cache():
    def row(policy, ratio, context, scores):
        return {
            "policy": policy,
            "budget": None,
            "ratio": ratio,
            "task": "variables",
            "context": context,
            "accuracy": sum(scores) / len(scores),
            "scores": scores,
        }

    rows = [
        row("none", None, 1000, [1, 1, 1, 0.8]),
        row("none", None, 2000, [1, 0.6, 1, 1]),
        row("none", None, 4000, [0, 0, 0.2, 0]),
        row("adamix", 0.9, 1000, [1, 1, 0.6, 0.8]),
        row("adamix", 0.9, 2000, [1, 0.6, 1, 1]),
    ]
    families = {r["policy"]: r for r in family_rows(rows, compared_cells(rows))}
    assert families["none"]["n"] == families["adamix"]["n"] == 8
    assert families["none"]["contexts"] == "1K 2K"
    assert families["adamix"]["of_full"] == pytest.approx(7.0 / 7.4)
