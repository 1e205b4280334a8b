"""The prompts of a provider's start-time fidelity check (supervisor/routes/fidelity.py), and the longer
sets the real-parts test and the benchmark hold it over: ordinary text of a few kinds, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

# The prompts of the start-time check: a few ordinary sentences of different kinds, each long enough
# (70-120 tokens with SmolLM2's tokenizer) for the provider's KV to carry the next token.  A few
# prompts, not thirty: the check runs at every start, on the decoder's time.
START_PROMPTS = (
    "The water cycle describes how water evaporates from oceans, lakes and rivers, rises as vapour, "
    "cools into clouds and falls again as rain or snow. Over land, some of it soaks into the soil and "
    "feeds the groundwater, some runs off into streams, and plants draw it up through their roots and "
    "release it from their leaves. Over a year the same molecule may travel thousands of kilometres. "
    "Explain in two sentences why deserts receive so little of it:",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n"
    "    result.extend(b[j:])\n    return result\n\n# Now a function that merges k sorted lists with a heap:\n",
    "Dear committee, I am writing to apply for the position of junior librarian advertised last week. "
    "For the past three years I have volunteered at the town library, where I catalogued donations, "
    "ran a weekly reading hour for children and helped visitors find their way around the archive. "
    "I enjoy quiet, careful work, and I am at ease with the catalogue software you use. In my "
    "previous role I also",
    "A recipe for bread: mix 500 g of flour with 10 g of salt and 7 g of dried yeast. Add 320 ml of "
    "warm water and knead for ten minutes until the dough is smooth and elastic. Leave it covered in a "
    "warm place for an hour, until it has doubled in size. Knock it back, shape it into a loaf, and "
    "let it rise again for half an hour. Bake at 220 degrees for",
)


# Two prompts past the static path's 256-token chunk (about 690 tokens each with SmolLM2's
# tokenizer): a KV written chunk by chunk, or a long context's rounding, shows only there.
LONG_PROMPTS = (
    " ".join(START_PROMPTS[i % 4].rstrip(":") + "." for i in range(7))
    + " Summarise the seven passages above in one line:",
    " ".join(START_PROMPTS[(i + 2) % 4].rstrip(":") + "." for i in range(7))
    + " Which passage above is the odd one out?",
)
# The start-time check's prompts: those that fit a slot (:func:`fitting`).
GATE_PROMPTS = START_PROMPTS + LONG_PROMPTS


def fitting(prompts: Sequence[list[int]], slot_context: int | None) -> list[list[int]]:
    """The prompts (as tokens) that leave a slot room for the one token each probe asks."""
    if slot_context is None:
        return list(prompts)
    return [tokens for tokens in prompts if len(tokens) + 2 <= slot_context]


# What the longer prompt sets are made of (the real-parts test's 30, the benchmark's): each of
# START_PROMPTS' kinds of text on other subjects.
_SUBJECTS = (
    "volcanoes",
    "the printing press",
    "honey bees",
    "railway signalling",
    "the immune system",
    "glaciers",
    "medieval castles",
    "solar panels",
    "octopuses",
    "the stock market",
)
_FRAMES = (
    "Here is a short encyclopedia article about {s}. It covers where the idea comes from, how it works "
    "in practice, what people commonly get wrong about it, and why it still matters today. The first "
    "section explains the basic mechanism in plain words, with one example that most readers will "
    "recognise from daily life. The second section, which follows, begins like this:",
    "Question from a student: my teacher asked us to write a paragraph about {s}, but I do not know "
    "where to start. Could you list three facts about {s} that are surprising, and say for each one "
    "why it is true? Please keep the language simple, since the paragraph is for a class of "
    "twelve-year-olds, and end with a question they could discuss together. Answer:",
    "Meeting notes, project review. Attendees discussed the exhibition about {s} planned for spring. "
    "The budget is fixed; the venue is confirmed for four weeks. Open items: the opening talk, the "
    "printed guide, and whether to add an interactive corner about {s} for children. Action items "
    "were assigned as follows. First,",
)


def prompt_set(n: int) -> list[str]:
    """``n`` distinct prompts of 60-120 tokens (SmolLM2's tokenizer): the start prompts, then frames x subjects."""
    texts = list(START_PROMPTS)
    texts += [frame.format(s=subject) for subject in _SUBJECTS for frame in _FRAMES]
    if n > len(texts):
        raise ValueError(f"at most {len(texts)} prompts")
    return texts[:n]
