"""A built-in synthetic English -> German corpus, so the demo runs offline (``data.source=toy``).

It stands in for WMT14 en-de (§5.1) when nothing can be downloaded, and keeps what makes
translation need attention rather than a word-by-word lookup:

* agreement: German articles and adjective endings follow gender, number and case (nominative
  subject, accusative or dative object, the case a preposition governs);
* verb second: a fronted adverbial or subordinate clause moves the finite verb before the subject
  ("today the dog sees the cat" -> "heute sieht der Hund die Katze");
* verb-final subordinate clauses ("..., weil der Hund die Katze sieht");
* the perfect's participle at the end of its clause ("der Hund hat die Katze gesehen").

English simple past and present perfect both become the German Perfekt, as in spoken German.
The German side is a deterministic function of the English side (no synonyms, no free word order),
so a small model can learn it almost perfectly. The words live in ``toy_lexicon.json`` beside this file.
The generator knows which English word each German word renders: ``generate_alignments`` gives each
pair's gold word alignment, sure and possible links, to score a model's alignments against.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

Entry = dict[str, Any]  # one lexicon entry, e.g. {"en": "dog", "de": "Hund", "gender": "m", ...}

MIN_WORDS, MAX_WORDS = 3, 40
TENSES = ("present", "perfect", "past")
TENSE_WEIGHTS = (5, 3, 2)

# Articles and adjective endings, by case and then gender ("pl": plural, where gender is neutralised).
DEFINITE = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
INDEFINITE = {  # an English bare plural ("dogs") has no article in German either
    "nom": {"m": "ein", "f": "eine", "n": "ein", "pl": ""},
    "acc": {"m": "einen", "f": "eine", "n": "ein", "pl": ""},
    "dat": {"m": "einem", "f": "einer", "n": "einem", "pl": ""},
}
WEAK_ENDINGS = {  # after the definite article
    "nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
    "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
    "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
}
MIXED_ENDINGS = {  # after ein/eine; the plural has no article, so its endings are the strong ones
    "nom": {"m": "er", "f": "e", "n": "es", "pl": "e"},
    "acc": {"m": "en", "f": "e", "n": "es", "pl": "e"},
    "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
}
CONTRACTIONS = {"in dem": "im", "in das": "ins", "zu dem": "zum", "zu der": "zur", "von dem": "vom"}
AUXILIARIES = {"haben": ("hat", "haben"), "sein": ("ist", "sind")}  # (3rd singular, 3rd plural)


@lru_cache(maxsize=1)
def load_lexicon() -> dict[str, list[Entry]]:
    """The lexicon by category: nouns, verbs, adjectives, adverbs, prepositions, conjunctions."""
    text = resources.files(__package__).joinpath("toy_lexicon.json").read_text(encoding="utf-8")
    return {name: entries for name, entries in json.loads(text).items() if isinstance(entries, list)}


def lemma(category: str, en: str, **fields: Any) -> Entry:
    """The one entry of ``category`` with English form ``en`` (and the given field values)."""
    found = [
        entry
        for entry in load_lexicon()[category]
        if entry["en"] == en and all(entry.get(key) == value for key, value in fields.items())
    ]
    if len(found) != 1:
        raise KeyError(f"{len(found)} {category} entries match {en!r} {fields}")
    return found[0]


@dataclass(frozen=True)
class NP:
    """A noun phrase: ``NP(dog, plural=True, adjectives=(big,))`` is "the big dogs" / "die großen Hunde"."""

    noun: Entry
    plural: bool = False
    definite: bool = True
    adjectives: tuple[Entry, ...] = ()


@dataclass(frozen=True)
class Clause:
    """Subject, verb, object and adjuncts; their order is chosen only when the clause is rendered."""

    subject: NP
    verb: Entry
    tense: str = "present"  # one of TENSES
    obj: NP | None = None  # in the case of the verb's frame: "acc" or "dat"
    pps: tuple[tuple[Entry, NP], ...] = ()  # (preposition, noun phrase) adjuncts
    adverb: Entry | None = None  # fronted adverbial; main clauses only
    complement: Clause | None = None  # the that-clause of a verb with frame "clause" (know, say, ...)


@dataclass(frozen=True)
class Sentence:
    """Main clauses joined by and/but, optionally with an adverbial clause (because, ...) before or after."""

    clauses: tuple[Clause, ...]
    links: tuple[Entry, ...] = ()  # coordinating conjunctions, one between each pair of clauses
    subordinate: tuple[Entry, Clause] | None = None
    fronted: bool = False  # the subordinate clause comes first, so the main verb precedes its subject


Key = tuple[Any, ...]  # where a word comes from in a sentence's structure: ("clause", 0, "subject", "noun")


class Word(NamedTuple):
    """One word of a rendered sentence and what it renders: an English word its one key (`sure`); a
    German word the keys it renders (`sure`) and those it only shares in (`possible`): "im" renders
    "in" and shares in "the", the Perfekt's auxiliary shares in its participle's verb and back."""

    text: str
    sure: tuple[Key, ...] = ()
    possible: tuple[Key, ...] = ()


def at(key: Key, *part: Any) -> tuple[Key]:
    """The one key of a word at `part` of the structure `key` names."""
    return (key + part,)


def text_of(words: list[Word]) -> str:
    return " ".join(word.text for word in words)


def punctuated(words: list[Word], mark: str) -> list[Word]:
    """The words with `mark` (",", ".") attached to the last, as the text writes it."""
    return [*words[:-1], words[-1]._replace(text=words[-1].text + mark)]


def english_np_words(np: NP, key: Key = ()) -> list[Word]:
    words = [Word(a["en"], at(key, "adjective", i)) for i, a in enumerate(np.adjectives)]
    words.append(Word(np.noun["en_pl" if np.plural else "en"], at(key, "noun")))
    if np.definite:
        return [Word("the", at(key, "article")), *words]
    if np.plural:
        return words
    return [Word("an" if words[0].text[0] in "aeiou" else "a", at(key, "article")), *words]


def german_np_words(np: NP, case: str, key: Key = ()) -> list[Word]:
    """Article, adjectives and noun in ``case`` ("nom", "acc" or "dat")."""
    number = "pl" if np.plural else np.noun["gender"]
    article = (DEFINITE if np.definite else INDEFINITE)[case][number]
    ending = (WEAK_ENDINGS if np.definite else MIXED_ENDINGS)[case][number]
    # a stem ending in -e absorbs the ending's e: müde + en -> müden
    words = [Word(article, at(key, "article"))] if article else []
    for i, a in enumerate(np.adjectives):
        words.append(
            Word(a["de"] + (ending[1:] if a["de"].endswith("e") else ending), at(key, "adjective", i))
        )
    noun = np.noun["de_pl" if np.plural else "de"]
    if np.plural and case == "dat" and not noun.endswith(("n", "s")):
        noun += "n"  # dative plural: den Hunden, but den Katzen, den Autos
    return [*words, Word(noun, at(key, "noun"))]


def german_np(np: NP, case: str) -> str:
    """Article, adjectives and noun in ``case`` ("nom", "acc" or "dat")."""
    return text_of(german_np_words(np, case))


def german_pp_words(preposition: Entry, np: NP, key: Key = ()) -> list[Word]:
    """Preposition plus noun phrase in the case it governs, contracted where German must: im, zum, ...;
    a contraction renders the preposition and shares in the article."""
    first, *rest = german_np_words(np, preposition["case"], key + ("np",))
    contracted = CONTRACTIONS.get(f"{preposition['de']} {first.text}")
    if contracted:
        return [Word(contracted, at(key, "preposition"), first.sure), *rest]
    return [Word(preposition["de"], at(key, "preposition")), first, *rest]


def english_pp_words(preposition: Entry, np: NP, key: Key = ()) -> list[Word]:
    """A preposition of one or more words ("in front of") plus its noun phrase."""
    words = [Word(part, at(key, "preposition")) for part in preposition["en"].split()]
    return words + english_np_words(np, key + ("np",))


def english_clause_words(clause: Clause, key: Key = ()) -> list[Word]:
    verb, plural = clause.verb, clause.subject.plural
    if clause.tense == "present":
        verb_phrase = [Word(verb["en" if plural else "en_3sg"], at(key, "verb"))]
    elif clause.tense == "past":
        verb_phrase = [Word(verb["en_past"], at(key, "verb"))]
    else:
        auxiliary = Word("have" if plural else "has", at(key, "auxiliary"))
        verb_phrase = [auxiliary, Word(verb["en_pp"], at(key, "verb"))]
    words = [Word(clause.adverb["en"], at(key, "adverb"))] if clause.adverb else []
    words += [*english_np_words(clause.subject, key + ("subject",)), *verb_phrase]
    words += english_np_words(clause.obj, key + ("object",)) if clause.obj else []
    for i, (preposition, np) in enumerate(clause.pps):
        words += english_pp_words(preposition, np, key + ("pp", i))
    if clause.complement:
        words.append(Word(lemma("conjunctions", "that")["en"], at(key, "that")))
        words += english_clause_words(clause.complement, key + ("complement",))
    return words


def german_clause_words(clause: Clause, order: str, key: Key = ()) -> list[Word]:
    """The clause in ``order``: "main" (verb second), "inverted" (verb first, the slot before it
    being taken by a fronted subordinate clause) or "sub" (verb last, after a conjunction)."""
    verb, plural = clause.verb, clause.subject.plural
    if clause.tense == "present":
        finite, participle = [Word(verb["de_3pl" if plural else "de_3sg"], at(key, "verb"))], []
    else:  # Perfekt: the auxiliary takes the finite slot, the participle closes the clause; each
        # shares in the other's English word (a simple past's one word is rendered by both)
        finite = [Word(AUXILIARIES[verb["aux"]][plural], at(key, "auxiliary"), at(key, "verb"))]
        participle = [Word(verb["de_pp"], at(key, "verb"), at(key, "auxiliary"))]
    subject = german_np_words(clause.subject, "nom", key + ("subject",))
    middle = german_np_words(clause.obj, verb["frame"], key + ("object",)) if clause.obj else []
    for i, (preposition, np) in enumerate(clause.pps):
        middle += german_pp_words(preposition, np, key + ("pp", i))
    if order == "sub":
        words = [*subject, *middle, *participle, *finite]
    elif order == "inverted":
        words = [*finite, *subject, *middle, *participle]
    elif clause.adverb:
        words = [Word(clause.adverb["de"], at(key, "adverb")), *finite, *subject, *middle, *participle]
    else:
        words = [*subject, *finite, *middle, *participle]
    if clause.complement:  # extraposed after the participle: "hat gesagt, dass ..."
        that = Word(lemma("conjunctions", "that")["de"], at(key, "that"))
        words = [
            *punctuated(words, ","),
            that,
            *german_clause_words(clause.complement, "sub", key + ("complement",)),
        ]
    return words


def render_words(sentence: Sentence) -> tuple[list[Word], list[Word]]:
    """The (English, German) words, capitalised and with a final period."""
    first = sentence.clauses[0]
    en = english_clause_words(first, ("clause", 0))
    de = german_clause_words(first, "inverted" if sentence.fronted else "main", ("clause", 0))
    for i, (link, clause) in enumerate(zip(sentence.links, sentence.clauses[1:], strict=True), start=1):
        if link["comma"]:
            en, de = punctuated(en, ","), punctuated(de, ",")
        en += [Word(link["en"], (("link", i),)), *english_clause_words(clause, ("clause", i))]
        de += [Word(link["de"], (("link", i),)), *german_clause_words(clause, "main", ("clause", i))]
    if sentence.subordinate:
        conjunction, clause = sentence.subordinate
        en_sub = [
            Word(conjunction["en"], (("conjunction",),)),
            *english_clause_words(clause, ("subordinate",)),
        ]
        de_sub = [
            Word(conjunction["de"], (("conjunction",),)),
            *german_clause_words(clause, "sub", ("subordinate",)),
        ]
        if sentence.fronted:
            en, de = punctuated(en_sub, ",") + en, punctuated(de_sub, ",") + de
        else:
            en, de = punctuated(en, ",") + en_sub, punctuated(de, ",") + de_sub
    return _capitalised(punctuated(en, ".")), _capitalised(punctuated(de, "."))


def _capitalised(words: list[Word]) -> list[Word]:
    first = words[0]
    return [first._replace(text=first.text[0].upper() + first.text[1:]), *words[1:]]


def render(sentence: Sentence) -> tuple[str, str]:
    """The (English, German) pair, capitalised and with a final period."""
    en, de = render_words(sentence)
    return text_of(en), text_of(de)


def gold_alignment(en: list[Word], de: list[Word]) -> str:
    """The word alignment of a rendered pair, "i-j" (English word i, German word j, from 0) for a sure
    link and "ipj" for a possible one, German word by German word: each German word links every English
    word whose key it renders (sure) or shares in (possible)."""
    links = []
    for j, word in enumerate(de):
        for i, english in enumerate(en):
            if english.sure[0] in word.sure:
                links.append(f"{i}-{j}")
            elif english.sure[0] in word.possible:
                links.append(f"{i}p{j}")
    return " ".join(links)


@dataclass(frozen=True)
class _Pools:
    """The lexicon split into the lists the sampler draws from."""

    nouns: list[Entry]
    animate: list[Entry]
    adjectives: list[Entry]
    adverbs: list[Entry]
    verbs: dict[str, list[Entry]]  # by frame
    static_preps: list[Entry]  # "in the garden"; directional ones ("into") only follow motion verbs
    all_preps: list[Entry]
    subordinators: list[Entry]
    coordinators: list[Entry]


@lru_cache(maxsize=1)
def _pools() -> _Pools:
    lexicon = load_lexicon()
    verbs: dict[str, list[Entry]] = {}
    for verb in lexicon["verbs"]:
        verbs.setdefault(verb["frame"], []).append(verb)
    conjunctions = lexicon["conjunctions"]
    return _Pools(
        nouns=lexicon["nouns"],
        animate=[noun for noun in lexicon["nouns"] if noun["animate"]],
        adjectives=lexicon["adjectives"],
        adverbs=lexicon["adverbs"],
        verbs=verbs,
        static_preps=[p for p in lexicon["prepositions"] if not p["directional"]],
        all_preps=lexicon["prepositions"],
        subordinators=[c for c in conjunctions if c["type"] == "subordinating"],
        coordinators=[c for c in conjunctions if c["type"] == "coordinating"],
    )


def _random_np(rng: random.Random, pools: _Pools, animate: bool) -> NP:
    noun = rng.choice(pools.animate if animate else pools.nouns)
    n_adjectives = rng.choices((0, 1, 2), weights=(7, 3, 1))[0]
    adjectives = tuple(rng.sample(pools.adjectives, n_adjectives))
    return NP(noun, plural=rng.random() < 0.3, definite=rng.random() < 0.6, adjectives=adjectives)


def _random_clause(rng: random.Random, pools: _Pools, adverb: bool, frame: str | None = None) -> Clause:
    """A random clause; ``adverb`` allows a fronted adverbial, ``frame="clause"`` forces a that-clause."""
    frame = frame or rng.choices(("acc", "dat", "none"), weights=(6, 1, 3))[0]
    verb = rng.choice(pools.verbs[frame])
    fronted = rng.choice(pools.adverbs) if adverb and rng.random() < 0.3 else None
    tense = rng.choice(fronted["tenses"]) if fronted else rng.choices(TENSES, weights=TENSE_WEIGHTS)[0]
    subject = _random_np(rng, pools, animate=True)
    obj = _random_np(rng, pools, animate=frame == "dat") if frame in ("acc", "dat") else None
    preps = pools.all_preps if verb.get("motion") else pools.static_preps
    n_pps = 0 if frame == "clause" else rng.choices((0, 1, 2), weights=(6, 3, 1))[0]
    pps = tuple((rng.choice(preps), _random_np(rng, pools, animate=False)) for _ in range(n_pps))
    complement = _random_clause(rng, pools, adverb=False) if frame == "clause" else None
    return Clause(subject, verb, tense, obj, pps, fronted, complement)


def _random_sentence(rng: random.Random, pools: _Pools) -> Sentence:
    """A random sentence. A that-clause or trailing subordinate clause always ends the sentence, so
    where an embedded clause stops is never ambiguous in English (German would place its verb differently)."""
    if rng.random() < 0.2:  # "because the cat sings, the dog sleeps" -> "weil ..., schläft der Hund"
        subordinate = (rng.choice(pools.subordinators), _random_clause(rng, pools, adverb=False))
        main = _random_clause(rng, pools, adverb=False, frame="clause" if rng.random() < 0.2 else None)
        return Sentence((main,), (), subordinate, fronted=True)
    n_clauses = rng.choices((1, 2, 3), weights=(14, 5, 1))[0]
    ending = rng.choices(("none", "that", "subordinate"), weights=(50, 20, 30))[0]
    clauses = [_random_clause(rng, pools, adverb=True) for _ in range(n_clauses - 1)]
    clauses.append(_random_clause(rng, pools, adverb=True, frame="clause" if ending == "that" else None))
    links = tuple(rng.choice(pools.coordinators) for _ in range(n_clauses - 1))
    subordinate = None
    if ending == "subordinate":
        frame = "clause" if rng.random() < 0.15 else None
        subordinate = (rng.choice(pools.subordinators), _random_clause(rng, pools, adverb=False, frame=frame))
    return Sentence(tuple(clauses), links, subordinate)


def _rendered(n: int, seed: int) -> Iterator[tuple[list[Word], list[Word]]]:
    """``n`` distinct (English, German) sentences of 3-40 words as words, the same for the same ``seed``."""
    if n < 0:
        raise ValueError(f"cannot generate {n} sentence pairs: the count must be 0 or more")
    rng, pools = random.Random(seed), _pools()
    seen: set[str] = set()
    while len(seen) < n:
        en, de = render_words(_random_sentence(rng, pools))
        text = text_of(en)
        if text not in seen and MIN_WORDS <= len(en) <= MAX_WORDS and len(de) <= MAX_WORDS:
            seen.add(text)
            yield en, de


def generate_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct (English, German) pairs of 3-40 words, the same for the same ``seed``."""
    return [(text_of(en), text_of(de)) for en, de in _rendered(n, seed)]


def generate_alignments(n: int, seed: int) -> list[str]:
    """The gold word alignment (`gold_alignment`) of each pair of ``generate_pairs(n, seed)``; the
    test split is drawn first, so ``generate_alignments(n_test, seed)`` is the test split's."""
    return [gold_alignment(en, de) for en, de in _rendered(n, seed)]


def generate_splits(n_train: int, n_valid: int, n_test: int, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Train, valid and test splits with no English sentence in two of them.

    Test and valid are drawn first, so they stay the same when only ``n_train`` changes.
    """
    sizes = {"test": n_test, "valid": n_valid, "train": n_train}
    for name, size in sizes.items():
        if size < 0:
            raise ValueError(f"the toy {name} split needs 0 or more sentence pairs, got {size}")
    pairs = generate_pairs(sum(sizes.values()), seed)
    splits, start = {}, 0
    for name, size in sizes.items():
        splits[name] = pairs[start : start + size]
        start += size
    return {name: splits[name] for name in ("train", "valid", "test")}
