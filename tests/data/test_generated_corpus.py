"""The embedded story corpus: deterministic from its seed, grammatical agreement, the on-disk format."""

from __future__ import annotations

import re

import pytest

from lm_systems.data.checksums import sidecar
from lm_systems.data.generated_corpus import generate_stories, with_article, write_generated_corpus
from lm_systems.data.tokenizer import END_OF_TEXT


@pytest.mark.parametrize("seed", [0, 917, 2**29 + 3])
def test_same_seed_gives_the_same_stories_and_another_seed_different_ones(seed):
    first = list(generate_stories(37, seed))
    assert first == list(generate_stories(37, seed))
    other = list(generate_stories(37, seed + 1))
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 30


def test_a_longer_corpus_extends_a_shorter_one():
    assert list(generate_stories(50, 3))[:17] == list(generate_stories(17, 3))


def test_stories_have_structure_a_small_model_can_learn():
    stories = list(generate_stories(300, 11))
    assert len(set(stories)) == 300
    for story in stories:
        hero = re.search(r"named (\w+)|^(\w+) was", story)
        name = hero.group(1) or hero.group(2)
        assert story.count(name) >= 4, f"the hero's name should recur within the story: {story}"
        assert "because" in story and END_OF_TEXT not in story and "\n" not in story
        # Articles agree with the next word ("an apple", "a ball").
        assert not re.search(r"\ba [aeiou]", story) and not re.search(r"\ban [^aeiou\s]", story), story
    sad = [s for s in stories if " was sad because " in s]
    assert sad and all(" So " in s for s in sad), "sad stories must resolve through a 'So ...' action"


def test_pronouns_agree_with_the_hero():
    for story in generate_stories(200, 5):
        opening = re.match(
            r"(?:Once upon a time, )?(?:there was |One day, )?(?:an? \w+ (\w+) named (\w+)|(\w+) was an? \w+ (\w+))",
            story,
        )
        assert opening, story
        kind = opening.group(1) or opening.group(4)
        if kind == "girl":
            assert " She had a friend" in story
        if kind == "boy":
            assert " He had a friend" in story


def test_with_article():
    assert with_article("apple") == "an apple"
    assert with_article("orange ball") == "an orange ball"
    assert with_article("kite") == "a kite"


def test_file_holds_one_story_per_line_separated_by_end_of_text(tmp_path):
    path = write_generated_corpus(tmp_path / "stories.txt", 25, seed=2)
    text = path.read_text(encoding="utf-8")
    pieces = text.split(END_OF_TEXT)
    assert pieces[-1] == "" and len(pieces) == 26
    assert [p.rstrip("\n") for p in pieces[:-1]] == list(generate_stories(25, 2))
    assert sorted(tmp_path.iterdir()) == [path, sidecar(path)]  # no temporary file left, and its checksum


def test_no_stories_is_an_error():
    with pytest.raises(ValueError, match="at least one story"):
        list(generate_stories(0, 1))
