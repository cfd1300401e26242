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
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

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


def english_np(np: NP) -> str:
    words = [adjective["en"] for adjective in np.adjectives] + [np.noun["en_pl" if np.plural else "en"]]
    if np.definite:
        return " ".join(["the", *words])
    if np.plural:
        return " ".join(words)
    return " ".join(["an" if words[0][0] in "aeiou" else "a", *words])


def german_np(np: NP, case: str) -> str:
    """Article, adjectives and noun in ``case`` ("nom", "acc" or "dat")."""
    key = "pl" if np.plural else np.noun["gender"]
    article = (DEFINITE if np.definite else INDEFINITE)[case][key]
    ending = (WEAK_ENDINGS if np.definite else MIXED_ENDINGS)[case][key]
    # a stem ending in -e absorbs the ending's e: müde + en -> müden
    adjectives = [a["de"] + (ending[1:] if a["de"].endswith("e") else ending) for a in np.adjectives]
    noun = np.noun["de_pl" if np.plural else "de"]
    if np.plural and case == "dat" and not noun.endswith(("n", "s")):
        noun += "n"  # dative plural: den Hunden, but den Katzen, den Autos
    return " ".join(word for word in [article, *adjectives, noun] if word)


def german_pp(preposition: Entry, np: NP) -> str:
    """Preposition plus noun phrase in the case it governs, contracted where German must: im, zum, ..."""
    phrase = german_np(np, preposition["case"])
    article, _, rest = phrase.partition(" ")
    contracted = CONTRACTIONS.get(f"{preposition['de']} {article}")
    return f"{contracted} {rest}" if contracted else f"{preposition['de']} {phrase}"


def english_clause(clause: Clause) -> str:
    verb, plural = clause.verb, clause.subject.plural
    if clause.tense == "present":
        verb_phrase = verb["en" if plural else "en_3sg"]
    elif clause.tense == "past":
        verb_phrase = verb["en_past"]
    else:
        verb_phrase = f"{'have' if plural else 'has'} {verb['en_pp']}"
    words = [clause.adverb["en"]] if clause.adverb else []
    words += [english_np(clause.subject), verb_phrase]
    words += [english_np(clause.obj)] if clause.obj else []
    words += [f"{preposition['en']} {english_np(np)}" for preposition, np in clause.pps]
    if clause.complement:
        words += [lemma("conjunctions", "that")["en"], english_clause(clause.complement)]
    return " ".join(words)


def german_clause(clause: Clause, order: str) -> str:
    """The clause in ``order``: "main" (verb second), "inverted" (verb first, the slot before it
    being taken by a fronted subordinate clause) or "sub" (verb last, after a conjunction)."""
    verb, plural = clause.verb, clause.subject.plural
    if clause.tense == "present":
        finite, participle = verb["de_3pl" if plural else "de_3sg"], ""
    else:  # Perfekt: the auxiliary takes the finite slot, the participle closes the clause
        finite, participle = AUXILIARIES[verb["aux"]][plural], verb["de_pp"]
    subject = german_np(clause.subject, "nom")
    middle = [german_np(clause.obj, verb["frame"])] if clause.obj else []
    middle += [german_pp(preposition, np) for preposition, np in clause.pps]
    if order == "sub":
        words = [subject, *middle, participle, finite]
    elif order == "inverted":
        words = [finite, subject, *middle, participle]
    elif clause.adverb:
        words = [clause.adverb["de"], finite, subject, *middle, participle]
    else:
        words = [subject, finite, *middle, participle]
    text = " ".join(word for word in words if word)
    if clause.complement:  # extraposed after the participle: "hat gesagt, dass ..."
        text += f", {lemma('conjunctions', 'that')['de']} {german_clause(clause.complement, 'sub')}"
    return text


def render(sentence: Sentence) -> tuple[str, str]:
    """The (English, German) pair, capitalised and with a final period."""
    first = sentence.clauses[0]
    en, de = english_clause(first), german_clause(first, "inverted" if sentence.fronted else "main")
    for link, clause in zip(sentence.links, sentence.clauses[1:], strict=True):
        comma = "," if link["comma"] else ""
        en += f"{comma} {link['en']} {english_clause(clause)}"
        de += f"{comma} {link['de']} {german_clause(clause, 'main')}"
    if sentence.subordinate:
        conjunction, clause = sentence.subordinate
        en_sub = f"{conjunction['en']} {english_clause(clause)}"
        de_sub = f"{conjunction['de']} {german_clause(clause, 'sub')}"
        if sentence.fronted:
            en, de = f"{en_sub}, {en}", f"{de_sub}, {de}"
        else:
            en, de = f"{en}, {en_sub}", f"{de}, {de_sub}"
    return en[0].upper() + en[1:] + ".", de[0].upper() + de[1:] + "."


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


def generate_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct (English, German) pairs of 3-40 words, the same for the same ``seed``."""
    if n < 0:
        raise ValueError(f"cannot generate {n} sentence pairs: the count must be 0 or more")
    rng, pools = random.Random(seed), _pools()
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(pairs) < n:
        en, de = render(_random_sentence(rng, pools))
        if en not in seen and MIN_WORDS <= len(en.split()) <= MAX_WORDS and len(de.split()) <= MAX_WORDS:
            seen.add(en)
            pairs.append((en, de))
    return pairs


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
