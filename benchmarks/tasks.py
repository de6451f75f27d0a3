"""Long-context tasks generated locally: seeded, exact token lengths, the answer known.

Each task builds a prompt of exactly ``length`` tokens in the plain-completion
form the default model answers (``...\\nAnswer: The X is``), with
the fact asked for at ``depth`` (0 = first, 1 = last) of the context:

- ``passkey``: a five-digit key in repeated filler sentences, stated twice, under Mohtashami &
  Jaggi's header, asked for their way (`` What is the pass key? The pass key is``).
- ``niah``: a seven-digit "special magic number" for a word, in essay prose (RULER's single needle).
- ``multikey``: the same with one more needle for another word (a distractor) at a random depth:
  two-key retrieval.
- ``kv``: a dictionary of word-pair keys and five-digit values filling the context; one value asked for.
- ``twostage``: OmniKV's 2StageRetr (paper §A): a dictionary of numbers to colors and an addition
  whose sum is the key to look up; the model must add, then find that key's color.
- ``frequent``: essay prose in which one person is named, first name and surname, in one sentence per
  ``FREQUENT_EVERY`` tokens, spread over the first three quarters, and four others once each anywhere;
  asked who appears most often, by full name. No single sentence answers it: the answer is the name the
  whole context repeats, so the tokens that matter are many and spread (the heavy hitters H2O and D2O
  keep), and none is in the last quarter, which is all a recent window keeps at ratio 0.75. The first
  name is the answer's first token, which the prompt's last position computes over the full cache
  (compression runs at the prompt's end); the surname comes from decode steps over the compressed
  cache, so it is what a policy can lose. ``depth`` only seeds the draw.

RULER's other synthetic families (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv 2404.06654, §3 and its appendix), rebuilt from the paper's description; each asks
for several answers and scores the share of them found in the output (the paper's recall of references,
``score``):

- ``multivalue`` (MV-NIAH): four special magic numbers for one word in essay prose, the first at ``depth``
  and the others a quarter of the context apart; all four asked for.
- ``multiquery`` (MQ-NIAH): one number for each of four words, placed the same way; all four asked for.
- ``variables`` (VT, multi-hop tracing): ``VAR X1 = 12345``, then ``VAR X2 = X1`` and so on, four hops,
  the five statements at random depths in order in the repeated noise sentences; asked for every
  variable that holds the value. Names are five random capitals. As in RULER, a short answered instance
  (another chain) comes first: without it the default model answered no prompt (it repeated the noise).
- ``common_words`` (CWE, aggregation): a numbered list of words in which ``CWE_COMMON`` words recur
  ``CWE_COMMON_FREQ`` times (RULER's 30, fewer where the list is too short for that to be a minority)
  and the others ``CWE_RARE_FREQ`` times; asked for the common ones.
- ``frequent_words`` (FWE, aggregation): made-up words drawn from a Zipf distribution (exponent
  ``FWE_ALPHA``); asked for the three most frequent, which the draw makes unique.

Question answering (RULER's SQuAD and HotpotQA tasks) needs their data, which no package here ships, so it
is not built. Words for ``common_words`` come from the bundled essays; ``depth`` only seeds the draw for
``variables``, ``common_words`` and ``frequent_words``.

What mattered for the default model (docs/benchmarks.md has the measurements):
the passkey header and question. "There is a pass key hidden ... remember it"
made the model echo the header (full cache 0.6 at 1K, 0.2 at 2K); the classic
"important info ... I will quiz you" header with the question appended to the
filler answers every prompt at 1K and 2K. Three distractor needles were more
than the model tells apart at 2K; one is the two-key task the literature reports.
For ``frequent``, the answer stem ending in "is named": ending in "is", the model
often answered "not specified" instead of a name. Asked for the most frequent of
a plain list of words, it named the right one in none of 10 prompts at 1K.

A hit is the answer in the first ``ANSWER_TOKENS`` generated tokens (``LONG_ANSWER_TOKENS`` for the
tasks with several answers, RULER's lengths); for ``twostage`` and ``frequent``, the first color or person
the model names must be the right one (so naming every one does not score), and for ``frequent`` the
person's full name must follow.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from functools import cache, cached_property

from kvpolicy.offline.sample_text import haystack_text

#: RULER's families (see above), each scored by the share of its answers found.
RULER_TASKS = ("multivalue", "multiquery", "variables", "common_words", "frequent_words")
TASKS = ("passkey", "niah", "multikey", "kv", "twostage", "frequent", *RULER_TASKS)
ANSWER_TOKENS = 16
#: Tokens generated for the tasks with several answers: four seven-digit numbers take about 40 here.
LONG_ANSWER_TOKENS = {
    "multivalue": 64,
    "multiquery": 64,
    "variables": 32,
    "common_words": 64,
    "frequent_words": 32,
}
#: ``multivalue``'s values and ``multiquery``'s queries (RULER's four).
NEEDLES = 4
#: ``variables``: hops of the chain (RULER's four: five variables).
HOPS = 4
#: ``common_words``: RULER's ten words recurring 30 times, the others 3 times.
CWE_COMMON = 10
CWE_COMMON_FREQ = 30
CWE_RARE_FREQ = 3
#: ``frequent_words``: RULER's Zipf exponent, and the made-up vocabulary's size.
FWE_ALPHA = 2.0
FWE_VOCABULARY = 200
FWE_ANSWERS = 3
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
WORDS = (
    "apple",
    "river",
    "candle",
    "forest",
    "violin",
    "harbor",
    "pepper",
    "marble",
    "rocket",
    "garden",
    "saddle",
    "tunnel",
    "falcon",
    "button",
    "lantern",
    "meadow",
    "anchor",
    "walnut",
    "glacier",
    "pillow",
    "trumpet",
    "canyon",
    "ribbon",
    "orchard",
    "compass",
    "blanket",
    "thunder",
    "pebble",
    "mirror",
    "island",
)
COLORS = (
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "brown",
    "purple",
    "orange",
    "pink",
    "gray",
    "teal",
    "maroon",
    "violet",
    "lime",
    "olive",
    "navy",
    "gold",
    "silver",
    "beige",
)
DISTRACTORS = 1
#: Names none of the haystack's essays uses, so the only people in a ``frequent`` prompt are the ones put there.
NAMES = (
    "Alice",
    "Bob",
    "Carol",
    "Emma",
    "Irene",
    "Jack",
    "Laura",
    "Nora",
    "Oscar",
    "Paula",
    "Quinn",
    "Rosa",
    "Tina",
    "Victor",
    "Olivia",
    "Liam",
    "Noah",
    "Mia",
    "Lucas",
    "Ava",
)
#: ``frequent``'s surnames, several tokens each, drawn per prompt: a surname is copied from the cache, not guessed.
SURNAMES = (
    "Whitfield",
    "Ashworth",
    "Pemberton",
    "Kowalski",
    "Delacroix",
    "Fairbanks",
    "Lindqvist",
    "Okonkwo",
    "Brannigan",
    "Castellano",
    "Hargreaves",
    "Thornbury",
)
ACTIVITIES = (
    "went for a walk",
    "read a book",
    "cooked dinner",
    "called a friend",
    "wrote a letter",
    "planted a tree",
    "painted the fence",
    "fixed the bike",
    "visited the market",
    "sang a song",
    "fed the cat",
    "cleaned the house",
)
#: ``frequent``: the main person is named once per this many tokens of the prompt (20 times at 1K).
FREQUENT_EVERY = 50
#: ``frequent``: the share of the prompt, at its end, where the main person is never named.
FREQUENT_TAIL = 0.25
#: ``frequent``: the other people, each named once.
OTHERS = 4


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task and what its answer must contain."""

    task: str
    length: int
    depth: float
    ids: list[int]
    answer: str
    #: Every answer a RULER family asks for (``answer`` is them joined); empty for a task with one answer.
    answers: tuple[str, ...] = ()


def answer_tokens(task: str) -> int:
    """Tokens generated for an answer to ``task``."""
    return LONG_ANSWER_TOKENS.get(task, ANSWER_TOKENS)


def score(item: TaskItem, text: str) -> float:
    """The share of the item's answers in ``text`` as whole words (RULER's recall, case ignored); a hit or not
    for a task with one answer."""
    if item.answers:
        return sum(
            re.search(rf"\b{re.escape(answer)}\b", text, re.IGNORECASE) is not None for answer in item.answers
        ) / len(item.answers)
    return float(is_hit(item, text))


@cache
def essay_words() -> tuple[str, ...]:
    """The bundled essays' lowercase words of 4-9 letters, sorted: ``common_words``'s vocabulary."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,9}\b", haystack_text()))))


def is_hit(item: TaskItem, text: str) -> bool:
    if item.task == "twostage":
        named = re.findall(r"[a-z]+", text.lower())
        return next((w for w in named if w in COLORS), None) == item.answer
    if item.task == "frequent":
        first = re.search(rf"\b(?:{'|'.join(NAMES)})\b(?: [A-Za-z]+)?", text)
        return first is not None and first.group() == item.answer
    return item.answer in text


class TaskBuilder:
    """Builds the prompts of every task for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def _prose(self) -> tuple[int, ...]:
        return tuple(self.encode(haystack_text()))

    @cached_property
    def _filler_sentence(self) -> tuple[int, ...]:
        return tuple(self.encode(FILLER))

    def prose(self, count: int, rng: random.Random) -> list[int]:
        ids = self._prose
        start = rng.randrange(len(ids) - count)
        return list(ids[start : start + count])

    def repeated_filler(self, count: int) -> list[int]:
        sentence = self._filler_sentence
        return list((sentence * (count // len(sentence) + 1))[:count])

    def sentence_boundary(self, ids: list[int], at: int) -> int:
        """The first place at or after ``at`` that follows a token ending a sentence (or ``at``)."""
        for i in range(max(at, 1), len(ids)):
            if self.tokenizer.decode(ids[i - 1 : i]).rstrip().endswith((".", "!", "?")):
                return i
        return at

    def insert(self, filler: list[int], needles: list[tuple[float, list[int]]]) -> list[int]:
        """Needles placed at their depths of ``filler`` (at sentence boundaries), in depth order."""
        out, taken = [], 0
        for depth, needle in sorted(needles, key=lambda n: n[0]):
            at = max(taken, self.sentence_boundary(filler, round(depth * len(filler))))
            out += filler[taken:at] + needle
            taken = at
        return out + filler[taken:]

    def fit(
        self,
        task: str,
        length: int,
        depth: float,
        head: str,
        needles: list[tuple[float, str]],
        question: str,
        answer: str,
        haystack: str,
        rng: random.Random,
        answers: tuple[str, ...] = (),
    ) -> TaskItem:
        head_ids, question_ids = self.encode(head), self.encode(question)
        needle_ids = [(d, self.encode(text)) for d, text in needles]
        room = length - len(head_ids) - len(question_ids) - sum(len(ids) for _, ids in needle_ids)
        if room <= 0:
            raise ValueError(f"{task}: {length} tokens leave no room for filler")
        filler = self.prose(room, rng) if haystack == "prose" else self.repeated_filler(room)
        ids = head_ids + self.insert(filler, needle_ids) + question_ids
        return TaskItem(task, length, depth, ids, answer, answers)

    def passkey(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        key = str(rng.randrange(10000, 100000))
        head = (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n\n"
        )
        needle = f" The pass key is {key}. Remember it. {key} is the pass key."
        return self.fit(
            "passkey",
            length,
            depth,
            head,
            [(depth, needle)],
            " What is the pass key? The pass key is",
            key,
            "filler",
            rng,
        )

    def _magic_numbers(self, task: str, length: int, depth: float, rng: random.Random, distractors: int) -> TaskItem:
        words = rng.sample(WORDS, 1 + distractors)
        numbers = [str(rng.randrange(1000000, 10000000)) for _ in words]
        depths = [depth] + [rng.random() for _ in range(distractors)]
        needles = [(d, f" The special magic number for {w} is {n}.") for d, w, n in zip(depths, words, numbers)]
        head = "Some special magic numbers are hidden in the essays below. Find them and remember them.\n\n"
        question = (
            f"\n\nWhat is the special magic number for {words[0]}?\nAnswer: The special magic number for {words[0]} is"
        )
        return self.fit(task, length, depth, head, needles, question, numbers[0], "prose", rng)

    def niah(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        return self._magic_numbers("niah", length, depth, rng, 0)

    def multikey(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        return self._magic_numbers("multikey", length, depth, rng, DISTRACTORS)

    def frequent(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        people = [
            f"{name} {surname}"
            for name, surname in zip(rng.sample(NAMES, 1 + OTHERS), rng.sample(SURNAMES, 1 + OTHERS))
        ]
        main, *others = people
        mentions = [(rng.uniform(0, 1 - FREQUENT_TAIL), main) for _ in range(length // FREQUENT_EVERY)]
        mentions += [(rng.random(), name) for name in others]
        needles = [(at, f" {name} {rng.choice(ACTIVITIES)}.") for at, name in mentions]
        head = "Below is a story. One person appears in it far more often than anyone else.\n\n"
        question = (
            "\n\nQuestion: Which person appears most often in the story above? Give their full name.\n"
            "Answer: The person who appears most often is named"
        )
        return self.fit("frequent", length, depth, head, needles, question, main, "prose", rng)

    def kv(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        head = "Below is a dictionary of keys and values. Remember them.\n\n{"
        longest = f"{max(WORDS, key=len)}-{max(WORDS, key=len)}-99"
        keys: set[str] = set()

        def entry() -> tuple[str, str, str]:
            key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(100)}"
            if key in keys:
                return entry()
            keys.add(key)
            value = str(rng.randrange(10000, 100000))
            return key, value, f' "{key}": {value},'

        def question(key: str) -> str:
            return f'}}\n\nWhat is the value of "{key}"?\nAnswer: The value of "{key}" is'

        entries = self._entries(length, head, question(longest), entry)
        key, value, _ = entries[round(depth * (len(entries) - 1))]
        return self._dictionary("kv", length, depth, head, entries, question(key), value)

    def twostage(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        head = (
            "Let's play a game. You have a dict and an addition. Add the two numbers, find that key "
            "in the dict, and answer with its color. The dict is {"
        )
        counter = iter(range(10**6))

        def entry() -> tuple[int, str, str]:
            key, color = next(counter), rng.choice(COLORS)
            return key, color, f" {key}: {color},"

        def question(left: int, right: int) -> str:
            return f"}}\n\nThe equation is {left} + {right} = ?\nAnswer: {left} + {right} ="

        entries = self._entries(length, head, question(9999, 9999), entry)
        key = max(2, round(depth * (len(entries) - 1)))
        left = rng.randrange(1, key)
        return self._dictionary("twostage", length, depth, head, entries, question(left, key - left), entries[key][1])

    def _entries(self, length: int, head: str, longest_question: str, entry) -> list[tuple]:
        """Dictionary entries ``(key, value, token ids)``, in order, as many as fit beside the head and the
        longest question; ``entry()`` draws the next ``(key, value, text)``."""
        room = length - len(self.encode(head)) - len(self.encode(longest_question))
        entries = []
        while True:
            key, value, text = entry()
            ids = self.encode(text)
            room -= len(ids)
            if room < 0:
                return entries
            entries.append((key, value, ids))

    def _dictionary(
        self, task: str, length: int, depth: float, head: str, entries: list, question: str, answer: str
    ) -> TaskItem:
        """A dictionary prompt, padded to ``length`` with spaces before its closing brace."""
        body = self.encode(head) + [t for _, _, ids in entries for t in ids]
        tail = self.encode(question)
        pad = length - len(body) - len(tail)
        return TaskItem(task, length, depth, body + self.encode(" ") * pad + tail, answer)

    def _spread(self, depth: float) -> list[float]:
        """``NEEDLES`` depths a ``1 / NEEDLES`` of the context apart, the first at ``depth``."""
        return [(depth + i / NEEDLES) % 1 for i in range(NEEDLES)]

    def _numbers_for(self, task: str, length: int, depth: float, words: list[str], numbers: list[str], rng) -> TaskItem:
        """RULER's needles, ``One of the special magic numbers for {word} is: {number}.``, spread from ``depth``;
        every number asked for, of every word."""
        needles = [
            (d, f" One of the special magic numbers for {w} is: {n}.")
            for d, w, n in zip(self._spread(depth), words, numbers)
        ]
        query = words[0] if len(set(words)) == 1 else ", ".join(words[:-1]) + f" and {words[-1]}"
        head = (
            "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n\n"
        )
        question = (
            f"\n\nWhat are all the special magic numbers for {query} mentioned in the provided text?\n"
            f"Answer: The special magic numbers for {query} mentioned in the provided text are"
        )
        return self.fit(task, length, depth, head, needles, question, ", ".join(numbers), "prose", rng, tuple(numbers))

    def _magic_number(self, rng: random.Random) -> str:
        return str(rng.randrange(1000000, 10000000))

    def multivalue(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        word = rng.choice(WORDS)
        numbers = [self._magic_number(rng) for _ in range(NEEDLES)]
        return self._numbers_for("multivalue", length, depth, [word] * NEEDLES, numbers, rng)

    def multiquery(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        words = rng.sample(WORDS, NEEDLES)
        numbers = [self._magic_number(rng) for _ in range(NEEDLES)]
        return self._numbers_for("multiquery", length, depth, words, numbers, rng)

    @staticmethod
    def _chain(rng: random.Random, taken: tuple[str, ...] = ()) -> tuple[list[str], str]:
        """``HOPS + 1`` distinct variable names (none of ``taken``) and the value the first is assigned."""
        names: list[str] = []
        while len(names) < HOPS + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names and name not in taken and name != "VAR":
                names.append(name)
        return names, str(rng.randrange(10000, 100000))

    @staticmethod
    def _chain_statements(names: list[str], value: str) -> list[str]:
        return [f" VAR {name} = {source}." for name, source in zip(names, [value, *names[:-1]])]

    @staticmethod
    def _chain_question(names: list[str], value: str) -> str:
        return (
            f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above.\n"
            f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables "
            f"are assigned the value {value}, they are:"
        )

    def variables(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        shown, shown_value = self._chain(rng)
        names, value = self._chain(rng, tuple(shown))
        intro = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
        # RULER's one-shot demonstration: a short instance, answered, before the task.
        example = FILLER.join(self._chain_statements(shown, shown_value))
        head = (
            f"{intro}{FILLER.strip()}{example}{FILLER}{self._chain_question(shown, shown_value)} "
            f"{', '.join(shown)}.\n\n{intro}"
        )
        depths = sorted(rng.random() for _ in names)
        needles = list(zip(depths, self._chain_statements(names, value)))
        question = self._chain_question(names, value)
        return self.fit(
            "variables", length, depth, head, needles, question, ", ".join(names), "filler", rng, tuple(names)
        )

    def _listing(self, task: str, length: int, depth: float, head: str, question: str, draw, rng) -> TaskItem:
        """A prompt whose whole context is the text ``draw(count)`` returns (with its answers) for the largest
        ``count`` that fits (a bisection), padded to ``length`` with spaces."""
        head_ids, question_ids = self.encode(head), self.encode(question)
        room = length - len(head_ids) - len(question_ids)
        low, high, fitting = 1, room, None
        while low <= high:
            count = (low + high) // 2
            text, answers = draw(count)
            ids = self.encode(text)
            if len(ids) <= room:
                low, fitting = count + 1, (ids, answers)
            else:
                high = count - 1
        if fitting is None:
            raise ValueError(f"{task}: {length} tokens leave no room for the list")
        ids, answers = fitting
        ids = head_ids + ids + self.encode(" ") * (room - len(ids)) + question_ids
        return TaskItem(task, length, depth, ids, ", ".join(answers), tuple(answers))

    def common_words(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        head = "Below is a numbered list of words. Some of them appear far more often than the others.\n\n"
        question = (
            f"\n\nQuestion: What are the {CWE_COMMON} most common words in the above list?\n"
            f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
        )
        draw_rng = random.Random(rng.random())

        def draw(count: int) -> tuple[str, list[str]]:
            rng = random.Random(draw_rng.random())
            frequency = min(CWE_COMMON_FREQ, max(CWE_RARE_FREQ + 1, count // (2 * CWE_COMMON)))
            rare = max(0, count - CWE_COMMON * frequency) // CWE_RARE_FREQ
            words = rng.sample(essay_words(), CWE_COMMON + rare)
            listing = words[:CWE_COMMON] * frequency + words[CWE_COMMON:] * CWE_RARE_FREQ
            rng.shuffle(listing)
            return "".join(f" {i}. {word}" for i, word in enumerate(listing, 1)), words[:CWE_COMMON]

        return self._listing("common_words", length, depth, head, question, draw, rng)

    def frequent_words(self, length: int, depth: float, rng: random.Random) -> TaskItem:
        head = (
            "Read the following coded text and track the frequency of each coded word. "
            f"Find the {FWE_ANSWERS} most frequently appearing coded words.\n\n"
        )
        question = (
            f"\n\nQuestion: What are the {FWE_ANSWERS} most frequently appearing words in the above coded text?\n"
            f"Answer: According to the coded text above, the {FWE_ANSWERS} most frequently appearing words are:"
        )
        vocabulary: list[str] = []
        while len(vocabulary) < FWE_VOCABULARY:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 6)))
            if word not in vocabulary:
                vocabulary.append(word)
        weights = [1 / rank**FWE_ALPHA for rank in range(1, FWE_VOCABULARY + 1)]
        draw_rng = random.Random(rng.random())

        def draw(count: int) -> tuple[str, list[str]]:
            rng = random.Random(draw_rng.random())
            while True:  # redrawn until the three most frequent are unique
                words = rng.choices(vocabulary, weights, k=count)
                ranked = Counter(words).most_common(FWE_ANSWERS + 1)
                if len(ranked) > FWE_ANSWERS and ranked[FWE_ANSWERS - 1][1] > ranked[FWE_ANSWERS][1]:
                    return " " + " ".join(words), [word for word, _ in ranked[:FWE_ANSWERS]]

        return self._listing("frequent_words", length, depth, head, question, draw, rng)

    def build(self, task: str, length: int, depth: float, seed: int) -> TaskItem:
        """One prompt; the same (task, length, depth, seed) always gives the same tokens."""
        rng = random.Random(f"{task}-{length}-{depth}-{seed}")
        return getattr(self, task)(length, depth, rng)
