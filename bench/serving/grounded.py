"""The grounded workload: chats whose answers copy long spans of their prompt.

Rewriting, fixing typos, quoting and editing code are what speculative
decoding without a draft model is for: the answer repeats the input, so the
input proposes the answer. The open-chat set is the control: questions whose
answers repeat little. The texts are written for this benchmark.
"""

from __future__ import annotations

PASSAGES = [
    "The old harbour town wakes before sunrise. Fishing boats slip out past the stone "
    "breakwater while the bakery on the corner fires its ovens, and by the time the "
    "market opens the first crates of mackerel are already stacked on the quay.",
    "A compiler reads source code, checks that it follows the rules of the language, "
    "and translates it into instructions a processor can run. Good compilers also "
    "rearrange the work so that the program runs faster without changing its meaning.",
    "Bees communicate the location of flowers through a dance. The angle of the dance "
    "relative to the vertical comb shows the direction of the food relative to the sun, "
    "and the length of the waggle run tells the other bees how far they must fly.",
    "To repot a houseplant, water it the day before, loosen the root ball gently, and "
    "choose a pot only slightly larger than the old one. Fill the gap with fresh soil, "
    "press it down lightly, and keep the plant out of direct sun for a week.",
    "The library extended its opening hours for the exam season. From Monday to "
    "Thursday the reading rooms stay open until midnight, the cafe serves coffee until "
    "ten, and students may book the small study rooms for up to three hours a day.",
    "Glaciers move because ice deforms under its own weight. Near the bed the ice can "
    "also slide over a thin film of meltwater, which is why a glacier often speeds up "
    "in early summer when surface water drains down through cracks.",
]

TYPO_SENTENCES = [
    "The comittee will annouce the resluts of the competiton on Frday afternon.",
    "Please remeber to bring you're pasport and a copy of the bookng confirmaton.",
    "Our new softwear update fixs several bugs and improvs the batery life of the devise.",
    "The resturant on the corner serfs the best pasta in town, acording to the locals.",
]

CODE_SNIPPETS = [
    ("Rename the variable `x` to `total` everywhere in this function and return the "
     "whole function:",
     "def sum_prices(items):\n    x = 0\n    for item in items:\n        x += item.price * "
     "item.quantity\n    if x > 100:\n        x = x * 0.9\n    return x\n"),
    ("Add a docstring to this function and return the whole function unchanged "
     "otherwise:",
     "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n"
     "            return user\n    return None\n"),
    ("Change this loop to skip empty lines and return the whole function:",
     "def count_words(lines):\n    counts = {}\n    for line in lines:\n        for word in "
     "line.split():\n            counts[word] = counts.get(word, 0) + 1\n    return counts\n"),
]

OPEN_QUESTIONS = [
    "What are three good habits for staying focused while working from home?",
    "Write a short poem about the first snow of winter.",
    "Explain in simple words why the sky is blue.",
    "Give me an idea for a birthday party for a ten year old.",
    "What should I pack for a weekend hiking trip?",
    "Tell a short story about a robot who learns to paint.",
    "How do I start learning to play the guitar?",
    "Suggest a simple dinner I can cook in twenty minutes.",
    "Why do cats purr?",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the benefits of reading every day?",
    "Invent a new board game and explain its rules briefly.",
]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def grounded_chats() -> list[list[dict]]:
    """Rewrite, quote, fix-the-typos and code-edit chats (a fresh list each call)."""
    chats = []
    for passage in PASSAGES:
        chats.append(_user(f"Quote the following passage exactly:\n\n{passage}"))
        chats.append(_user("Rewrite this passage in the past tense, changing nothing "
                           f"else:\n\n{passage}"))
    for sentence in TYPO_SENTENCES:
        chats.append(_user(f"Fix the spelling mistakes and return the sentence:\n\n{sentence}"))
    for instruction, code in CODE_SNIPPETS:
        chats.append(_user(f"{instruction}\n\n```python\n{code}```"))
    return chats


def open_chats() -> list[list[dict]]:
    """Open questions (a fresh list each call)."""
    return [_user(question) for question in OPEN_QUESTIONS]
