"""The embedded default corpus: short children's stories generated from a small grammar, no download.

Each story follows one causal plot (a lost toy, a quarrel over a toy, rain, a toy stuck up a tree,
a scary noise, hunger): a hero and a friend are introduced, a problem makes the hero feel something
*because* of it, *so* someone acts, and the story closes with a moral. Names recur within a story,
pronouns agree with the character ("she ... her"), articles with the noun ("an apple"), and the
sentence templates repeat across stories: structure a tiny model can learn in a few hundred steps.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from lm_systems.data.checksums import checked_writer, sidecar_damage
from lm_systems.data.tokenizer import END_OF_TEXT

GENERATOR_VERSION = 1
"""Bump whenever the grammar changes: cached corpora, tokenizers and tokens are keyed on it."""

GIRLS = (
    "Lily",
    "Mia",
    "Sue",
    "Anna",
    "Emma",
    "Lucy",
    "Zoe",
    "Ella",
    "Rosa",
    "Kim",
    "Amy",
    "Nina",
    "Sara",
    "Ivy",
    "Ruby",
    "Daisy",
    "Molly",
    "Grace",
    "Hannah",
    "Jane",
)
BOYS = (
    "Tom",
    "Ben",
    "Max",
    "Sam",
    "Leo",
    "Jack",
    "Tim",
    "Finn",
    "Joe",
    "Dan",
    "Noah",
    "Owen",
    "Bob",
    "Jake",
    "Luke",
    "Oscar",
    "Peter",
    "Ryan",
    "Timmy",
    "Adam",
)
KINDS = (
    "girl",
    "boy",
    "cat",
    "dog",
    "bunny",
    "bear",
    "bird",
    "duck",
    "fox",
    "frog",
    "mouse",
    "lion",
    "owl",
    "pig",
    "puppy",
    "kitten",
)
ADJECTIVES = (
    "little",
    "small",
    "happy",
    "brave",
    "kind",
    "shy",
    "curious",
    "silly",
    "friendly",
    "clever",
    "gentle",
    "tiny",
    "funny",
    "quiet",
    "old",
    "young",
)
PLACES = (
    "park",
    "garden",
    "forest",
    "beach",
    "farm",
    "river",
    "hill",
    "house",
    "school",
    "town",
    "lake",
    "zoo",
    "field",
    "yard",
    "meadow",
    "village",
    "pond",
    "playground",
)
TOYS = (
    "ball",
    "kite",
    "toy car",
    "red hat",
    "blue box",
    "big drum",
    "shiny stone",
    "book",
    "doll",
    "boat",
    "balloon",
    "shell",
    "teddy bear",
    "orange ball",
    "old map",
    "yellow truck",
    "little train",
    "green whistle",
    "umbrella",
    "puzzle",
)
FOODS = ("apple", "cake", "cookie", "sandwich", "orange", "banana", "pie", "carrot", "egg", "muffin")
HIDING_SPOTS = (
    "under the bed",
    "behind a tree",
    "in the grass",
    "under a big rock",
    "in a box",
    "near the door",
    "under the table",
    "behind the sofa",
    "in the sand",
    "next to the pond",
)
GAMES = ("play", "run", "jump", "sing", "dance", "read", "draw", "swim", "climb", "dig")
GAMES_PAST = {
    "play": "played",
    "run": "ran",
    "jump": "jumped",
    "sing": "sang",
    "dance": "danced",
    "read": "read",
    "draw": "drew",
    "swim": "swam",
    "climb": "climbed",
    "dig": "dug",
}
INDOOR_GAMES = (
    "built a tower of blocks",
    "played a game of cards",
    "drew pictures of the sun",
    "read a book about the sea",
    "baked cookies with Mom",
    "made a fort with pillows",
)
NOISE_MAKERS = ("a little bird", "a small frog", "the wind", "a happy dog", "an old cow", "a baby duck")
MORALS = {
    "lost": ("friends help each other", "it is good to ask for help", "looking together is easier"),
    "take": ("it is good to share", "saying sorry makes things right", "sharing is more fun"),
    "rain": ("you can have fun anywhere", "a rainy day can be a good day", "playing inside can be fun"),
    "stuck": ("friends help each other", "working together solves problems", "it is good to ask for help"),
    "scared": ("not everything that is loud is scary", "being brave is good", "it is good to be brave"),
    "hungry": ("it is good to share", "sharing makes friends happy", "kind hearts share"),
}


@dataclass(frozen=True)
class Character:
    """A story character: name, kind and the pronouns that must agree with it."""

    name: str
    kind: str
    adjective: str
    he: str
    him: str
    his: str

    @classmethod
    def random(cls, rng: random.Random, exclude: str = "") -> "Character":
        is_girl = rng.random() < 0.5
        names = [n for n in (GIRLS if is_girl else BOYS) if n != exclude]
        kind = rng.choice(KINDS)
        if kind in ("girl", "boy"):
            kind = "girl" if is_girl else "boy"
        he, him, his = ("she", "her", "her") if is_girl else ("he", "him", "his")
        return cls(rng.choice(names), kind, rng.choice(ADJECTIVES), he, him, his)


def with_article(noun: str) -> str:
    """``apple`` → ``an apple``, ``ball`` → ``a ball``."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _opening(rng: random.Random, hero: Character, place: str) -> str:
    return rng.choice(
        (
            f"Once upon a time, there was {with_article(hero.adjective)} {hero.kind} named {hero.name}.",
            f"Once upon a time, {with_article(hero.adjective)} {hero.kind} named {hero.name} lived near the {place}.",
            f"One day, {with_article(hero.adjective)} {hero.kind} named {hero.name} went to the {place}.",
            f"{hero.name} was {with_article(hero.adjective)} {hero.kind} who lived by the {place}.",
        )
    )


def _lost(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    spot = rng.choice(HIDING_SPOTS)
    return [
        f"One day, {hero.name} could not find {hero.his} {toy}.",
        f"{hero.he.capitalize()} looked in the {place}, but the {toy} was not there.",
        f"{hero.name} was sad because {hero.he} lost {hero.his} {toy}.",
        f'{hero.he.capitalize()} said, "{friend.name}, can you help me find my {toy}?"',
        f'"Yes, I can help you," said {friend.name}.',
        f"So {friend.name} and {hero.name} looked together.",
        f"At last, {friend.name} found the {toy} {spot}.",
        f"{hero.name} was happy again because {hero.he} had {hero.his} {toy} back.",
        f'{hero.he.capitalize()} said, "Thank you, {friend.name}!"',
    ]


def _take(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    return [
        f"One day, {friend.name} took {hero.name}'s {toy} and ran to the {place}.",
        f"{hero.name} was angry because {friend.name} took {hero.his} {toy}.",
        f'{hero.he.capitalize()} said, "Please give me back my {toy}, {friend.name}."',
        f"{friend.name} saw that {hero.name} was angry, so {friend.he} felt bad.",
        f'{friend.he.capitalize()} said, "I am sorry, {hero.name}. I just wanted to play with your {toy}."',
        f"So {hero.name} and {friend.name} played with the {toy} together.",
        f"They had a lot of fun in the {place}.",
    ]


def _rain(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    game = rng.choice(GAMES)
    return [
        f"One day, {hero.name} wanted to go to the {place} to {game} with {friend.name}.",
        "But then it started to rain.",
        f"{hero.name} was sad because {hero.he} could not {game} in the {place}.",
        f'{friend.name} said, "Do not be sad, {hero.name}. We can play inside."',
        f"So {hero.name} and {friend.name} stayed inside and {rng.choice(INDOOR_GAMES)}.",
        f"{hero.name} was happy because {hero.he} had fun with {friend.name}.",
        f"When the rain stopped, they went to the {place} and {GAMES_PAST[game]} all day.",
    ]


def _stuck(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    return [
        f"One day, {hero.name} threw {hero.his} {toy} up high in the {place}.",
        f"The {toy} got stuck in a tall tree.",
        f"{hero.name} was sad because {hero.he} could not reach {hero.his} {toy}.",
        f'{hero.he.capitalize()} said, "Oh no! My {toy} is stuck!"',
        f"{friend.name} saw {hero.name} and wanted to help {hero.him}.",
        f"So {friend.name} found a long stick and pushed the {toy} out of the tree.",
        f"The {toy} fell down, and {hero.name} caught it.",
        f"{hero.name} was happy because {hero.his} friend helped {hero.him}.",
    ]


def _scared(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    maker = rng.choice(NOISE_MAKERS)
    return [
        f"One night, {hero.name} heard a loud noise from the {place}.",
        f"{hero.name} was scared because {hero.he} did not know what made the noise.",
        f'{hero.he.capitalize()} said, "{friend.name}, will you come with me to see?"',
        f'"Yes, I will come with you," said {friend.name}.',
        f"So {hero.name} and {friend.name} went to the {place} together.",
        f"They looked and looked, and they found {maker}.",
        f"It was just {maker}! {hero.name} and {friend.name} laughed.",
        f"{hero.name} was not scared anymore because the noise was only {maker}.",
    ]


def _hungry(rng: random.Random, hero: Character, friend: Character, place: str, toy: str) -> list[str]:
    food = rng.choice(FOODS)
    return [
        f"One day, {hero.name} and {friend.name} played in the {place} all morning.",
        f"{friend.name} was hungry because {friend.he} did not eat breakfast.",
        f"{hero.name} had {with_article(food)} in {hero.his} bag.",
        f"{hero.name} saw that {friend.name} was hungry, so {hero.he} gave {friend.name} half of {hero.his} {food}.",
        f'{friend.name} said, "Thank you, {hero.name}! This {food} is very good."',
        f"{friend.name} was happy because {hero.name} shared {hero.his} {food}.",
    ]


PLOTS = {"lost": _lost, "take": _take, "rain": _rain, "stuck": _stuck, "scared": _scared, "hungry": _hungry}


def generate_story(rng: random.Random) -> str:
    """One story, drawn from ``rng``: opening, hero's habit, friend, a plot from ``PLOTS``, moral."""
    hero = Character.random(rng)
    friend = Character.random(rng, exclude=hero.name)
    place, toy = rng.choice(PLACES), rng.choice(TOYS)
    game = rng.choice(GAMES)
    plot = rng.choice(sorted(PLOTS))
    sentences = [
        _opening(rng, hero, place),
        f"{hero.name} loved to {game} with {hero.his} {toy}.",
        f"{hero.he.capitalize()} had a friend named {friend.name}, {with_article(friend.adjective)} {friend.kind}.",
        *PLOTS[plot](rng, hero, friend, place, toy),
        rng.choice(
            (
                f"From that day on, {hero.name} and {friend.name} were best friends.",
                f"{hero.name} learned that {rng.choice(MORALS[plot])}.",
                f"{hero.name} and {friend.name} learned that {rng.choice(MORALS[plot])}.",
            )
        ),
        "The end." if rng.random() < 0.5 else "",
    ]
    return " ".join(s for s in sentences if s)


def generate_stories(num_stories: int, seed: int) -> Iterator[str]:
    """``num_stories`` stories; story ``i`` depends only on ``(seed, i)``, so a longer corpus extends a shorter one."""
    if num_stories <= 0:
        raise ValueError(f"the generated corpus needs at least one story, got num_stories={num_stories}")
    for index in range(num_stories):
        yield generate_story(random.Random(seed * 1_000_003 + index))


def write_generated_corpus(path: str | Path, num_stories: int, seed: int) -> Path:
    """Write the stories to ``path``, each story on one line and followed by ``<|endoftext|>`` (with a checksum)."""
    path = Path(path)
    with checked_writer(path) as file:
        for story in generate_stories(num_stories, seed):
            file.write(f"{story}\n{END_OF_TEXT}".encode())
    return path


def ensure_generated_corpus(path: str | Path, num_stories: int, seed: int) -> Path:
    """The corpus at ``path``: written if missing, and again (with a warning naming it) if it is not what was
    written."""
    path = Path(path)
    if path.is_file():
        problem = sidecar_damage(path)
        if problem is None:
            return path
        warnings.warn(f"the generated corpus is damaged: {problem}; rebuilding it", stacklevel=2)
    return write_generated_corpus(path, num_stories, seed)
