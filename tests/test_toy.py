"""The synthetic corpus: determinism, splits, lengths, lexicon, and German grammar on hand-written examples.

The expected German strings below are written from German grammar, not copied from the generator.
"""

from __future__ import annotations

import hashlib
import re

import pytest

from transformer.data.toy import (
    NP,
    Clause,
    Sentence,
    generate_alignments,
    generate_pairs,
    generate_splits,
    german_np,
    gold_alignment,
    lemma,
    load_lexicon,
    render,
    render_words,
)


def noun(en: str) -> dict:
    return lemma("nouns", en)


def verb(en: str, frame: str = "acc") -> dict:
    return lemma("verbs", en, frame=frame)


def adj(en: str) -> dict:
    return lemma("adjectives", en)


def prep(en: str) -> dict:
    return lemma("prepositions", en)


def the(en: str, *adjectives: str, plural: bool = False) -> NP:
    return NP(noun(en), plural=plural, definite=True, adjectives=tuple(adj(a) for a in adjectives))


def a(en: str, *adjectives: str, plural: bool = False) -> NP:
    return NP(noun(en), plural=plural, definite=False, adjectives=tuple(adj(a) for a in adjectives))


def one(clause: Clause) -> tuple[str, str]:
    return render(Sentence((clause,)))


def dog_ran_into_the_garden() -> Clause:
    """Yesterday the dog ran into the garden: a simple past, a motion verb's preposition."""
    return Clause(
        the("dog"),
        verb("run", "none"),
        "past",
        pps=((prep("into"), the("garden")),),
        adverb=lemma("adverbs", "yesterday"),
    )


# ---------------------------------------------------------------- corpus-level properties


def test_same_seed_same_pairs_other_seed_other_pairs():
    assert generate_pairs(300, seed=7) == generate_pairs(300, seed=7)
    assert generate_pairs(300, seed=7) != generate_pairs(300, seed=8)


def test_german_is_a_function_of_the_english():
    # two independent seeds share some (short) sentences; each must get the same German both times
    first, second = dict(generate_pairs(20000, seed=0)), dict(generate_pairs(20000, seed=1))
    shared = set(first) & set(second)
    assert len(shared) > 10
    assert all(first[en] == second[en] for en in shared)


def test_splits_have_the_sizes_and_share_no_english_sentence():
    splits = generate_splits(n_train=3000, n_valid=300, n_test=300, seed=1)
    assert {name: len(pairs) for name, pairs in splits.items()} == {"train": 3000, "valid": 300, "test": 300}
    english = {name: [en for en, _ in pairs] for name, pairs in splits.items()}
    for name, sentences in english.items():
        assert len(set(sentences)) == len(sentences), f"duplicates in {name}"
    assert not set(english["train"]) & set(english["valid"])
    assert not set(english["train"]) & set(english["test"])
    assert not set(english["valid"]) & set(english["test"])


def test_the_demos_test_split_is_the_same_text_byte_for_byte():
    # the demo's data (data/toy) and its BLEU were made from exactly these 1,000 pairs
    text = "".join(f"{en}\t{de}\n" for en, de in generate_splits(50000, 1000, 1000, seed=1234)["test"])
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "864bd2b6d70db224943122b1d28a5ecb430bd00ce938d95b533fa5a747374a22"
    )


def test_test_split_does_not_depend_on_the_training_size():
    small = generate_splits(n_train=100, n_valid=50, n_test=50, seed=3)
    large = generate_splits(n_train=900, n_valid=50, n_test=50, seed=3)
    assert small["test"] == large["test"] and small["valid"] == large["valid"]


def test_negative_sizes_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="test split"):
        generate_splits(n_train=10, n_valid=1, n_test=-1, seed=0)
    with pytest.raises(ValueError, match="0 or more"):
        generate_pairs(-5, seed=0)


def test_sentences_are_3_to_40_words_capitalised_and_end_with_a_period():
    pairs = generate_pairs(3000, seed=2)
    for en, de in pairs:
        for text in (en, de):
            assert 3 <= len(text.split()) <= 40, text
            assert text[0].isupper() and text.endswith(".") and not text.endswith(".."), text
    lengths = [len(en.split()) for en, _ in pairs]
    assert min(lengths) < 6 and max(lengths) > 25  # varied, not one fixed template length


def test_the_reordering_phenomena_are_frequent():
    german = [de for _, de in generate_pairs(2000, seed=4)]
    fronted_adverb = sum(de.split()[0] in ("Heute", "Gestern", "Morgen", "Jetzt") for de in german)
    subordinate = sum(
        any(f", {c} " in de or de.startswith(c.capitalize()) for c in ("weil", "dass", "obwohl"))
        for de in german
    )
    perfect = sum(any(w in de.split() for w in ("hat", "haben", "ist", "sind")) for de in german)
    assert fronted_adverb > 50 and subordinate > 400 and perfect > 600


# ---------------------------------------------------------------- lexicon


def test_lexicon_has_150_lemmas_in_every_category():
    lexicon = load_lexicon()
    content = ("nouns", "verbs", "adjectives", "adverbs", "prepositions")
    assert sum(len(lexicon[c]) for c in content) >= 150
    assert {n["gender"] for n in lexicon["nouns"]} == {"m", "f", "n"}
    assert {v["aux"] for v in lexicon["verbs"]} == {"haben", "sein"}
    assert {v["frame"] for v in lexicon["verbs"]} == {"acc", "dat", "none", "clause"}
    assert {p["case"] for p in lexicon["prepositions"]} == {"acc", "dat"}
    assert {"today", "yesterday"} <= {adverb["en"] for adverb in lexicon["adverbs"]}
    assert all(n["de"][0].isupper() and n["de_pl"][0].isupper() for n in lexicon["nouns"])


def test_english_forms_do_not_make_the_translation_ambiguous():
    lexicon = load_lexicon()
    nouns = {n["en"] for n in lexicon["nouns"]}
    # "the fish saw ..." would hide the number German needs: singular and plural must differ
    assert all(n["en"] != n["en_pl"] for n in lexicon["nouns"])
    # "they read" (present) vs "they read" (past) would map one English string to two German ones
    present = {v[k] for v in lexicon["verbs"] for k in ("en", "en_3sg")}
    assert not present & {v["en_past"] for v in lexicon["verbs"]}
    assert not nouns & present and not nouns & {a["en"] for a in lexicon["adjectives"]}
    # "a"/"an" follows the spelling, so no lemma may start with a vowel letter read as a consonant
    assert not [
        w for w in nouns | {a["en"] for a in lexicon["adjectives"]} if w.startswith(("uni", "use", "eu"))
    ]


# ---------------------------------------------------------------- grammar on hand-written examples


@pytest.mark.parametrize(
    ("phrase", "case", "expected"),
    [
        (the("dog", "big"), "nom", "der große Hund"),
        (the("cat", "small"), "nom", "die kleine Katze"),
        (the("house", "old"), "nom", "das alte Haus"),
        (the("dog", "big"), "acc", "den großen Hund"),
        (the("cat", "small"), "acc", "die kleine Katze"),
        (the("house", "old"), "acc", "das alte Haus"),
        (the("dog", "big"), "dat", "dem großen Hund"),
        (the("cat", "small"), "dat", "der kleinen Katze"),
        (a("dog", "big"), "nom", "ein großer Hund"),
        (a("cat", "small"), "nom", "eine kleine Katze"),
        (a("house", "old"), "nom", "ein altes Haus"),
        (a("dog", "big"), "acc", "einen großen Hund"),
        (a("cat", "small"), "acc", "eine kleine Katze"),
        (a("house", "old"), "acc", "ein altes Haus"),
        (a("house", "old"), "dat", "einem alten Haus"),
        (the("dog", "big", plural=True), "nom", "die großen Hunde"),
        (the("dog", "big", plural=True), "dat", "den großen Hunden"),
        (a("dog", "big", plural=True), "nom", "große Hunde"),
        (a("dog", "big", plural=True), "dat", "großen Hunden"),
        (a("car", plural=True), "dat", "Autos"),
        (the("cat", "tired"), "nom", "die müde Katze"),
        (a("dog", "tired"), "nom", "ein müder Hund"),
        (the("dog", "tired", "old"), "acc", "den müden alten Hund"),
    ],
)
def test_articles_and_adjective_endings_follow_gender_number_and_case(phrase, case, expected):
    assert german_np(phrase, case) == expected


def test_english_article_a_or_an():
    assert one(Clause(a("dog", "old"), verb("see"), obj=a("apple"))) == (
        "An old dog sees an apple.",
        "Ein alter Hund sieht einen Apfel.",
    )


def test_fronted_adverb_moves_the_verb_before_the_subject():
    clause = Clause(the("dog"), verb("see"), obj=the("cat"), adverb=lemma("adverbs", "today"))
    assert one(clause) == ("Today the dog sees the cat.", "Heute sieht der Hund die Katze.")


def test_perfect_puts_the_participle_last_with_haben_or_sein():
    assert one(Clause(the("dog", plural=True), verb("see"), "perfect", obj=the("cat", plural=True))) == (
        "The dogs have seen the cats.",
        "Die Hunde haben die Katzen gesehen.",
    )
    ran = dog_ran_into_the_garden()
    assert one(ran) == (
        "Yesterday the dog ran into the garden.",
        "Gestern ist der Hund in den Garten gelaufen.",
    )


def test_prepositions_govern_their_case_and_contract():
    clause = Clause(
        the("man"), verb("sleep", "none"), pps=((prep("with"), the("dog")), (prep("in"), the("house")))
    )
    assert one(clause) == (
        "The man sleeps with the dog in the house.",
        "Der Mann schläft mit dem Hund im Haus.",
    )
    clause = Clause(
        a("child"), verb("go", "none"), pps=((prep("to"), the("school")), (prep("into"), the("house")))
    )
    assert one(clause)[1] == "Ein Kind geht zur Schule ins Haus."
    clause = Clause(the("woman"), verb("work", "none"), pps=((prep("for"), the("man")),))
    assert one(clause)[1] == "Die Frau arbeitet für den Mann."


def test_dative_verbs_take_a_dative_object():
    assert one(Clause(the("man"), verb("help", "dat"), obj=the("child"))) == (
        "The man helps the child.",
        "Der Mann hilft dem Kind.",
    )
    assert one(Clause(the("dog"), verb("follow", "dat"), "perfect", obj=the("man"))) == (
        "The dog has followed the man.",
        "Der Hund ist dem Mann gefolgt.",
    )


def test_subordinate_clauses_put_the_verb_last():
    sees = Clause(the("dog"), verb("see"), obj=the("cat"))
    seen = Clause(the("dog"), verb("see"), "perfect", obj=the("cat"))
    because = lemma("conjunctions", "because")
    sleeps = Clause(the("man"), verb("sleep", "none"))
    assert render(Sentence((sleeps,), subordinate=(because, sees))) == (
        "The man sleeps, because the dog sees the cat.",
        "Der Mann schläft, weil der Hund die Katze sieht.",
    )
    assert render(Sentence((sleeps,), subordinate=(because, seen)))[1] == (
        "Der Mann schläft, weil der Hund die Katze gesehen hat."
    )
    knows = Clause(the("man"), verb("know", "clause"), complement=sees)
    assert one(knows) == (
        "The man knows that the dog sees the cat.",
        "Der Mann weiß, dass der Hund die Katze sieht.",
    )
    said = Clause(the("woman"), verb("say", "clause"), "past", complement=seen)
    assert one(said)[1] == "Die Frau hat gesagt, dass der Hund die Katze gesehen hat."


def test_fronted_subordinate_clause_puts_the_main_verb_first():
    sleeps = Clause(the("dog"), verb("sleep", "none"))
    sings = Clause(the("cat"), verb("sing", "none"), "perfect")
    sentence = Sentence((sings,), subordinate=(lemma("conjunctions", "although"), sleeps), fronted=True)
    assert render(sentence) == (
        "Although the dog sleeps, the cat has sung.",
        "Obwohl der Hund schläft, hat die Katze gesungen.",
    )


def test_coordination_keeps_verb_second_in_each_clause():
    sleeps = Clause(the("dog"), verb("sleep", "none"))
    finds = Clause(a("cat"), verb("find"), "past", obj=a("ball"), adverb=lemma("adverbs", "yesterday"))
    assert render(Sentence((sleeps, finds), links=(lemma("conjunctions", "but"),))) == (
        "The dog sleeps, but yesterday a cat found a ball.",
        "Der Hund schläft, aber gestern hat eine Katze einen Ball gefunden.",
    )
    assert render(Sentence((sleeps, finds), links=(lemma("conjunctions", "and"),)))[1] == (
        "Der Hund schläft und gestern hat eine Katze einen Ball gefunden."
    )


def test_know_a_thing_and_know_a_fact_translate_differently():
    assert one(Clause(the("man"), verb("know", "acc"), obj=the("woman")))[1] == "Der Mann kennt die Frau."


# ---------------------------------------------------------------- gold word alignments


def aligned(sentence: Sentence) -> str:
    return gold_alignment(*render_words(sentence))


def test_gold_links_of_hand_picked_sentences():
    """English word i - German word j, "p" for possible; written from the sentences, not the code."""
    today = Clause(the("dog"), verb("see"), obj=the("cat"), adverb=lemma("adverbs", "today"))
    # Today the dog sees the cat. / Heute sieht der Hund die Katze.
    assert aligned(Sentence((today,))) == "0-0 3-1 1-2 2-3 4-4 5-5"
    ran = dog_ran_into_the_garden()
    # Yesterday the dog ran into the garden. / Gestern ist der Hund in den Garten gelaufen.
    assert aligned(Sentence((ran,))) == "0-0 3p1 1-2 2-3 4-4 5-5 6-6 3-7"
    sleeps = Clause(
        the("man"), verb("sleep", "none"), pps=((prep("with"), the("dog")), (prep("in"), the("house")))
    )
    # The man sleeps with the dog in the house. / Der Mann schläft mit dem Hund im Haus.
    assert aligned(Sentence((sleeps,))) == "0-0 1-1 2-2 3-3 4-4 5-5 6-6 7p6 8-7"
    seen = Clause(the("dog"), verb("see"), "perfect", obj=the("cat"))
    because = Sentence(
        (Clause(the("man"), verb("sleep", "none")),), subordinate=(lemma("conjunctions", "because"), seen)
    )
    # The man sleeps, because the dog has seen the cat. /
    # Der Mann schläft, weil der Hund die Katze gesehen hat.
    assert aligned(because) == "0-0 1-1 2-2 3-3 4-4 5-5 8-6 9-7 6p8 7-8 6-9 7p9"
    front = Clause(the("dog"), verb("sleep", "none"), pps=((prep("in front of"), the("house")),))
    # The dog sleeps in front of the house. / Der Hund schläft vor dem Haus.
    assert aligned(Sentence((front,))) == "0-0 1-1 2-2 3-3 4-3 5-3 6-4 7-5"
    sings = Clause(the("cat"), verb("sing", "none"), "perfect")
    fronted = Sentence(
        (sings,),
        subordinate=(lemma("conjunctions", "although"), Clause(the("dog"), verb("sleep", "none"))),
        fronted=True,
    )
    # Although the dog sleeps, the cat has sung. / Obwohl der Hund schläft, hat die Katze gesungen.
    assert aligned(fronted) == "0-0 1-1 2-2 3-3 6-4 7p4 4-5 5-6 6p7 7-7"


def links(line: str) -> list[tuple[int, str, int]]:
    """(English word, "-" sure or "p" possible, German word) of a gold line."""
    return [(int(i), mark, int(j)) for i, mark, j in re.findall(r"(\d+)([-p])(\d+)", line)]


def test_gold_links_cover_every_word_and_nouns_point_at_their_english_noun():
    pairs, gold = generate_pairs(500, seed=5), generate_alignments(500, seed=5)
    english_of = {}  # a German noun form -> the English forms of its noun
    for noun in load_lexicon()["nouns"]:
        for form in (noun["de"], noun["de_pl"], noun["de_pl"] + "n"):
            english_of.setdefault(form, set()).update((noun["en"], noun["en_pl"]))
    nouns = 0
    for (en, de), line in zip(pairs, gold):
        english, german = en.split(), [word.strip(".,") for word in de.split()]
        found = links(line)
        assert len(found) == len(line.split()), line
        assert {i for i, _, _ in found} == set(range(len(english))), (en, de, line)
        assert {j for _, _, j in found} == set(range(len(german))), (en, de, line)
        for j in (j for j, word in enumerate(german) if word in english_of):
            sure = {english[i].strip(".,").lower() for i, mark, k in found if k == j and mark == "-"}
            assert sure and sure <= english_of[german[j]], (en, de, line, german[j])
            nouns += 1
    assert nouns > 1000
