"""Synthetic held-out learning sets: NER sentences (CoNLL, IOB2) and extractive QA (SQuAD v2.0 JSON) built
from templates, with the entities and answers of the test split never seen in training.

    ner = ner_splits(seed=0)                           # {"train": [(tokens, tags)], "test": [...]}
    write_ner(out_dir)                                  # out_dir/ner-train.conll, out_dir/ner-test.conll
    write_qa(out_dir)                                   # out_dir/qa-train.json, out_dir/qa-test.json

Held out by construction: every pool an entity is drawn from (first names, surnames, town roots,
company stems, years) is cut into a train part and a test part by position, so no person, place,
company or date of the test split occurs in the train split, not even as a part (a test person's first
name is no train person's first name). Part of the test split also uses sentence templates (NER) and
question forms (QA) that training never shows: a model has to read the context, not recall a phrase.

Entity types are CoNLL-2003's PER, LOC, ORG plus DATE (OntoNotes'); multiword entities are B-/I- tagged.
Surface variety: lower-cased sentences, optional end punctuation, titles outside the entity ("Dr."),
people by surname alone (companies are named after surnames too), numbers that are not dates, and
several entities of one type per sentence or context (distractors).

QA contexts hold facts about two or three people and a company; nearly a fifth of the questions ask
about someone the context never names or a fact it never states (SQuAD 2.0's unanswerable questions).

Everything is drawn from one random.Random(seed): the same seed writes the same files byte for byte.

References: Tjong Kim Sang & De Meulder 2003 (CoNLL-2003 NER, IOB); Rajpurkar et al. 2016, 2018
(SQuAD v1.1, v2.0: the JSON layout, answer_start as a character offset, is_impossible).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from datadir.files import atomic_write_bytes

SPLITS = ("train", "test")

# -- pools (written here, no network); each is cut into train/test parts by position -------------

FIRST_NAMES = """Amelia Oliver Isla Arthur Freya Theo Ivy Leo Rosa Jonah Clara Felix Nora Hugo Elsie Ravi
Maya Tobias Ines Kofi Greta Mateo Alma Viktor Leila Casper Wren Omar Hazel Dmitri Juno Anders Priya Silas
Esme Bruno Talia Emeka Linnea Marco Sofia Ewan Yara Lukas Mira Nikhil Ada Soren Beatrix Rafael Ingrid
Kenji Olga Tariq Delphine Aurelio Saoirse Bastian Noor Idris Thea Cormac Lucia Anton Zara Malik""".split()
SURNAMES = """Hale Dorn Whitcombe Abara Lindqvist Moreau Castell Pryce Okafor Vance Tamsin Brannock
Ferreira Kowalski Ashdown Nakamura Reyes Haldane Ostrander Quayle Mbeki Sorensen Gallo Pemberton Varga
Achebe Lund Fairweather Iyer Brandt Calloway Novak Sterling Adeyemi Holt Mirza Castellanos Thorne Duval
Rasmussen Keane Baptiste Wolfe Petrov Marchetti Ellery Osei Grieve Takahashi Lowell Ferro Blackwood
Anand Stroud Delacroix Ruane Kessler Mendez Aldous Fontaine Hadley Obi Sandoval""".split()
TOWN_ROOTS = """Brack Ell Dun Mar Tor Wen Quel Ost Harl Fenn Gal Lind Corr Ash Bel Kest Norr Pell Rav Sil
Thorn Ulm Vard Yarr Zell Alder Bram Cald Drey Elm Frost Glen Hollin Ives Jarrow Kell Lorn Mire Nethe Orl
Pent Rook Stave Tarn Umber Vell Wyck Brenn Coll Dray Emble Farr Gorse Hask Innis Jory Kip Lask Mell""".split()
TOWN_SUFFIXES = "ford bury wick ton mere stead holm dale more by haven port field worth ley".split()
TOWN_PATTERNS = ("{}", "{}", "{}", "Port {}", "New {}", "Lake {}", "{} Falls", "{} Springs", "North {}", "Upper {}")
ORG_KINDS = """Industries Bank Logistics Analytics Press Foods Mining Labs Group Holdings Partners Software
Motors Textiles Pharmaceuticals Airlines Shipping Energy Insurance Robotics""".split()
ORG_PATTERNS = (
    "{} {}",
    "{} {}",
    "{} {}",
    "{} & {} {}",
    "{} {} Ltd",
    "{} {} Inc",
    "University of {}",
    "{} Institute of Technology",
)
MONTHS = """January February March April May June July August September October November December""".split()
YEARS = list(range(1850, 2040))
DATE_PATTERNS = ("{d} {m} {y}", "{m} {d} , {y}", "{m} {y}", "{y}", "{d} {m} {y}")
# Roles take "a" in the templates, so none starts with a vowel.
ROLES = "nurse teacher chemist pilot baker lawyer surveyor geologist carpenter doctor banker painter".split()
TITLES = ("Dr.", "Mr.", "Ms.", "Professor", "Judge", "Captain")


def _part(pool: list, split: str) -> list:
    """Every fourth item (from the fourth) is the test split's; the rest the train split's."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [x for i, x in enumerate(pool) if (i % 4 == 3) == (split == "test")]


@dataclass
class Pools:
    """One split's entity pools."""

    first: list[str]
    last: list[str]
    roots: list[str]
    years: list[int]

    @classmethod
    def for_split(cls, split: str) -> Pools:
        return cls(_part(FIRST_NAMES, split), _part(SURNAMES, split), _part(TOWN_ROOTS, split), _part(YEARS, split))


# -- entities: (surface tokens, type) ---------------------------------------------------------------


def person(rng: random.Random, pools: Pools) -> list[str]:
    """A full name, sometimes with a middle initial."""
    first, last = rng.choice(pools.first), rng.choice(pools.last)
    if rng.random() < 0.15:
        return [first, f"{rng.choice('ABCDEFGHJKLMNPRSTW')}.", last]
    return [first, last]


def place(rng: random.Random, pools: Pools) -> list[str]:
    town = rng.choice(pools.roots) + rng.choice(TOWN_SUFFIXES)
    return rng.choice(TOWN_PATTERNS).format(town).split()


def company(rng: random.Random, pools: Pools) -> list[str]:
    pattern = rng.choice(ORG_PATTERNS)
    stems = [rng.choice(pools.last + pools.roots) for _ in range(2)]
    if pattern.startswith("University") or pattern.endswith("Technology"):
        return pattern.format(rng.choice(pools.roots) + rng.choice(TOWN_SUFFIXES)).split()
    if pattern.count("{}") == 3:
        return pattern.format(stems[0], stems[1], rng.choice(ORG_KINDS)).split()
    return pattern.format(stems[0], rng.choice(ORG_KINDS)).split()


def date(rng: random.Random, pools: Pools, with_day: bool = False) -> list[str]:
    """A date that always names a year (so the splits' dates are disjoint by year)."""
    patterns = [p for p in DATE_PATTERNS if "{d}" in p] if with_day else DATE_PATTERNS
    return rng.choice(patterns).format(d=rng.randint(1, 28), m=rng.choice(MONTHS), y=rng.choice(pools.years)).split()


MAKERS = {"PER": person, "LOC": place, "ORG": company, "DATE": date}


def draw_distinct(rng: random.Random, pools: Pools, kind: str, n: int) -> list[list[str]]:
    """`n` different entities of one kind (one context never names two people the same)."""
    seen: set[str] = set()
    out: list[list[str]] = []
    while len(out) < n:
        entity = MAKERS[kind](rng, pools)
        if " ".join(entity) not in seen:
            seen.add(" ".join(entity))
            out.append(entity)
    return out


# -- NER ------------------------------------------------------------------------------------------

# Tokens separated by spaces; {PER}, {LOC}, {ORG}, {DATE} (and ...2 for a second one, {PERS} for a
# surname alone) are entities, {TITLE} {ROLE} {NUM} fill O tokens. The last NER_TEST_ONLY templates
# are never used for training.
NER_TEMPLATES = (
    "{PER} was born in {LOC} on {DATE} .",
    "{PER} moved to {LOC} in {DATE} to work for {ORG} .",
    "{ORG} opened a new office in {LOC} on {DATE} .",
    "On {DATE} , {PER} signed a contract with {ORG} .",
    "{TITLE} {PER} spoke at the conference in {LOC} .",
    "{ORG} hired {NUM} workers in {LOC} last year .",
    "According to {PER} , {ORG} will close its plant in {LOC} .",
    "{PER} and {PER2} met in {LOC} in {DATE} .",
    "The mayor of {LOC} , {PER} , resigned on {DATE} .",
    "{ORG} was founded by {PER} in {DATE} .",
    "{PER} , a {ROLE} from {LOC} , joined {ORG} in {DATE} .",
    "Shares of {ORG} fell {NUM} points after {PER} left the board .",
    "{PER} left {LOC} for {LOC2} on {DATE} .",
    "In {DATE} {ORG} bought {ORG2} for {NUM} million .",
    "{TITLE} {PER} of {ORG} was interviewed in {LOC} .",
    "The festival in {LOC} drew {NUM} visitors in {DATE} .",
    "{PER} told reporters that {ORG} had no plans to leave {LOC} .",
    "Police in {LOC} said {PER} was last seen on {DATE} .",
    "{ORG} and {ORG2} agreed to merge on {DATE} .",
    "Born in {LOC} , {PER} studied at {ORG} .",
    "{PER} , who works for {ORG} , lives in {LOC} with {NUM} cats .",
    "The bridge between {LOC} and {LOC2} opened on {DATE} .",
    "{PER} won the race in {LOC} ahead of {PER2} .",
    "Since {DATE} , {PER} has led {ORG} from its offices in {LOC} .",
    "Flights from {LOC} to {LOC2} were cancelled on {DATE} .",
    "{ORG} said on {DATE} that profits rose by {NUM} percent .",
    "A {ROLE} named {PER} found the letter in {LOC} .",
    "{PER} married {PER2} in {LOC} on {DATE} .",
    "Workers at {ORG} in {LOC} went on strike in {DATE} .",
    "{TITLE} {PER} and {TITLE} {PER2} published the study on {DATE} .",
    "The {ROLE} {PER} visited {ORG} in {LOC} .",
    "{PER} sold the farm near {LOC} to {ORG} in {DATE} .",
    "Nobody at {ORG} had heard of {PER} before {DATE} .",
    "{NUM} people attended the meeting in {LOC} on {DATE} .",
    "Last seen in {LOC} , {PER} is wanted by {ORG} .",
    "{PER} was appointed {ROLE} of {ORG} on {DATE} .",
    "{PERS} said the deal with {ORG} was final .",
    "Asked about {LOC} , {PERS} declined to comment .",
    "{PERS} joined {ORG} after leaving {ORG2} .",
    # test only
    "Reports from {LOC} suggest that {PER} will buy {ORG} before {DATE} .",
    "It was {PER} who first mapped the hills around {LOC} .",
    "After leaving {ORG} , {PER} retired to {LOC} .",
    "{ORG} , based in {LOC} , lost {NUM} customers in {DATE} .",
    "Why did {PER} leave {LOC} on {DATE} ?",
    "Thanks to {PER} , {ORG} survived the crisis of {DATE} .",
    "{PER} ( born {DATE} ) is a {ROLE} in {LOC} .",
    "The letter from {PER} reached {LOC} on {DATE} .",
    "According to her lawyer , {PERS} never visited {LOC} .",
    "{ORG} confirmed that {PERS} had resigned on {DATE} .",
)
NER_TEST_ONLY = 10


def surname(rng: random.Random, pools: Pools) -> list[str]:
    """A person by surname alone ("Hale said"), a word company names are made of too ("Hale Mining")."""
    return [rng.choice(pools.last)]


# slot: (entity type, maker)
_SLOTS = {
    "PER": ("PER", person),
    "PER2": ("PER", person),
    "PERS": ("PER", surname),
    "LOC": ("LOC", place),
    "LOC2": ("LOC", place),
    "ORG": ("ORG", company),
    "ORG2": ("ORG", company),
    "DATE": ("DATE", date),
}


def ner_templates(split: str) -> list[str]:
    """The train split's templates, or all of them for the test split (the last NER_TEST_ONLY unseen)."""
    return list(NER_TEMPLATES[:-NER_TEST_ONLY]) if split == "train" else list(NER_TEMPLATES)


def render_ner(rng: random.Random, pools: Pools, template: str) -> tuple[list[str], list[str]]:
    """One sentence from a template: (tokens, IOB2 tags), no entity twice in it."""
    tokens, tags, seen = [], [], set()
    for token in template.split():
        slot = token[1:-1] if token.startswith("{") and len(token) > 2 else None
        if slot in _SLOTS:
            kind, make = _SLOTS[slot]
            entity = make(rng, pools)
            while " ".join(entity) in seen:
                entity = make(rng, pools)
            seen.add(" ".join(entity))
            tokens += entity
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
        else:
            tokens.append(_filler(rng, slot) if slot else token)
            tags.append("O")
    return _vary_surface(rng, tokens, tags)


def _filler(rng: random.Random, slot: str) -> str:
    if slot == "NUM":  # numbers that are not dates: a model must not tag every number DATE
        return rng.choice(
            [str(rng.randint(2, 99)), str(rng.randint(100, 999)), f"{rng.randint(1, 9)},{rng.randint(100, 999)}"]
        )
    if slot == "ROLE":
        return rng.choice(ROLES)
    if slot == "TITLE":
        return rng.choice(TITLES)
    raise ValueError(f"unknown template slot {{{slot}}}")


def _vary_surface(rng: random.Random, tokens: list[str], tags: list[str]) -> tuple[list[str], list[str]]:
    """Some sentences lower-cased, some without end punctuation, some ending in '!'."""
    if rng.random() < 0.1:
        tokens = [t.lower() for t in tokens]
    if tokens[-1] == "." and rng.random() < 0.2:
        if rng.random() < 0.5:
            return tokens[:-1], tags[:-1]
        return tokens[:-1] + ["!"], tags
    return tokens, tags


def ner_split(split: str, n: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """`n` sentences of one split, templates cycled in a seeded order so each is used about as often."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    rng = random.Random(f"ner-{split}-{seed}")
    pools, templates = Pools.for_split(split), ner_templates(split)
    order: list[str] = []
    while len(order) < n:
        order += rng.sample(templates, len(templates))
    return [render_ner(rng, pools, t) for t in order[:n]]


def ner_splits(seed: int = 0, n_train: int = 2000, n_test: int = 400) -> dict[str, list]:
    return {"train": ner_split("train", n_train, seed), "test": ner_split("test", n_test, seed)}


def conll_text(sentences: list[tuple[list[str], list[str]]]) -> str:
    """CoNLL columns: 'token tag' per line, a blank line after each sentence."""
    return "".join("".join(f"{tok} {tag}\n" for tok, tag in zip(tokens, tags)) + "\n" for tokens, tags in sentences)


def write_ner(out_dir: str | os.PathLike, seed: int = 0, n_train: int = 2000, n_test: int = 400) -> dict:
    """out_dir/ner-train.conll and out_dir/ner-test.conll; returns their paths and sizes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, str | int] = {}
    for split, sentences in ner_splits(seed, n_train, n_test).items():
        path = out_dir / f"ner-{split}.conll"
        atomic_write_bytes(path, conll_text(sentences).encode("utf-8"))
        result[split], result[f"{split}_sentences"] = str(path), len(sentences)
    return result


# -- QA -------------------------------------------------------------------------------------------

# Context facts: a person P (born, works), their company O (based, founded by P2), and P3 who moved.
# Slots: P P2 P3 Pnew (people), LB LH LM (places), DB DF DM (dates), O Onew (companies), ROLE.
QA_FACTS = {
    "born": (
        "{P} was born in {LB} on {DB} .",
        "{P} was born on {DB} in {LB} .",
        "Born in {LB} on {DB} , {P} grew up near the sea .",
    ),
    "works": ("{P} works as a {ROLE} at {O} .", "{P} joined {O} as a {ROLE} .", "Today {P} is a {ROLE} with {O} ."),
    "based": ("{O} is based in {LH} .", "{O} has its headquarters in {LH} .", "The offices of {O} are in {LH} ."),
    "founded": ("{O} was founded by {P2} in {DF} .", "{P2} founded {O} in {DF} .", "In {DF} , {P2} started {O} ."),
    "moved": ("{P3} , a friend of {P} , moved to {LM} in {DM} .", "In {DM} {P3} moved to {LM} ."),
}
OPTIONAL_FACTS = ("founded", "moved")  # sometimes left out, so that questions about them have no answer
# (fact the answer is stated by, answer slot, question forms); the last form of each is test only.
QA_QUESTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "born",
        "LB",
        (
            "Where was {P} born ?",
            "In which town was {P} born ?",
            "What is the birthplace of {P} ?",
            "{P} was born in which place ?",
        ),
    ),
    (
        "born",
        "DB",
        (
            "When was {P} born ?",
            "On what date was {P} born ?",
            "What is the birth date of {P} ?",
            "{P} was born on which day ?",
        ),
    ),
    (
        "works",
        "O",
        (
            "Which company does {P} work for ?",
            "Where does {P} work ?",
            "Who employs {P} ?",
            "{P} is employed by which firm ?",
        ),
    ),
    ("based", "LH", ("Where is {O} based ?", "In which city is {O} headquartered ?", "Where are the offices of {O} ?")),
    ("founded", "P2", ("Who founded {O} ?", "Who is the founder of {O} ?", "{O} was started by whom ?")),
    ("founded", "DF", ("When was {O} founded ?", "In what year was {O} founded ?", "Since when has {O} existed ?")),
    ("moved", "LM", ("Where did {P3} move to ?", "To which town did {P3} move ?", "{P3} moved where ?")),
    ("moved", "DM", ("When did {P3} move to {LM} ?", "In which year did {P3} move ?")),
)
# Questions no context answers: about someone it never names, or a fact it never states about someone it does.
QA_UNANSWERABLE = (
    "Where was {Pnew} born ?",
    "When was {Pnew} born ?",
    "Which company does {Pnew} work for ?",
    "Who founded {Onew} ?",
    "Where is {Onew} based ?",
    "Where was {P2} born ?",
    "When was {P3} born ?",
    "Which company does {P3} work for ?",
)
_NO_SPACE_BEFORE, _NO_SPACE_AFTER = {".", ",", "?", "!", ")"}, {"("}
UNANSWERABLE_P = 0.9  # one unanswerable question with 4 answerable ones: 18% of all


def render_text(template: str, values: dict[str, list[str]]) -> tuple[str, dict[str, tuple[int, int]]]:
    """A template's text, detokenised (no space before . , ? !), and each slot's character span."""
    text, spans, previous = "", {}, None
    for token in template.split():
        slot = token[1:-1] if token.startswith("{") and len(token) > 2 else None
        words = values[slot] if slot else [token]
        if text and words[0] not in _NO_SPACE_BEFORE and previous not in _NO_SPACE_AFTER:
            text += " "
        start = len(text)
        text += detokenize(words)
        if slot:
            spans[slot] = (start, len(text))
        previous = words[-1]
    return text, spans


def detokenize(words: list[str]) -> str:
    """Words joined by spaces, but none before . , ? ! ) or after (."""
    return "".join(
        ("" if i == 0 or w in _NO_SPACE_BEFORE or words[i - 1] in _NO_SPACE_AFTER else " ") + w
        for i, w in enumerate(words)
    )


def qa_values(rng: random.Random, pools: Pools) -> dict[str, list[str]]:
    """The entities of one context (and Pnew, Onew, which it never names)."""
    people = draw_distinct(rng, pools, "PER", 4)
    places = draw_distinct(rng, pools, "LOC", 3)
    dates = [date(rng, pools, with_day=True)] + draw_distinct(rng, pools, "DATE", 2)
    companies = draw_distinct(rng, pools, "ORG", 2)
    return {
        "P": people[0],
        "P2": people[1],
        "P3": people[2],
        "Pnew": people[3],
        "LB": places[0],
        "LH": places[1],
        "LM": places[2],
        "DB": dates[0],
        "DF": dates[1],
        "DM": dates[2],
        "O": companies[0],
        "Onew": companies[1],
        "ROLE": [rng.choice(ROLES)],
    }


def qa_context(rng: random.Random, values: dict) -> tuple[str, set[str], dict[str, tuple[int, int]]]:
    """The context text, the facts it states, and each answer slot's character span in it."""
    facts = [f for f in QA_FACTS if f not in OPTIONAL_FACTS or rng.random() < 0.75]
    rng.shuffle(facts)
    text = ""
    spans: dict[str, tuple[int, int]] = {}
    for fact in facts:
        sentence, sentence_spans = render_text(rng.choice(QA_FACTS[fact]), values)
        offset = len(text) + (1 if text else 0)
        text += (" " if text else "") + sentence
        for slot, (a, b) in sentence_spans.items():
            spans.setdefault(slot, (a + offset, b + offset))  # an answer's first mention
    return text, set(facts), spans


def qa_questions(rng: random.Random, values: dict, facts: set[str], spans: dict, split: str) -> list[dict]:
    """Four answerable questions on stated facts and, most times, one that is not."""
    askable = [q for q in QA_QUESTIONS if q[0] in facts]
    qas = []
    for _fact, slot, forms in rng.sample(askable, min(4, len(askable))):
        forms = forms if split == "test" else forms[:-1]
        question, _ = render_text(rng.choice(forms), values)
        a, b = spans[slot]
        qas.append(
            {
                "question": _vary_question(rng, question),
                "is_impossible": False,
                "answers": [{"text": detokenize(values[slot]), "answer_start": a}],
            }
        )
    if rng.random() < UNANSWERABLE_P:
        question, _ = render_text(_unanswerable(rng, facts), values)
        qas.append({"question": _vary_question(rng, question), "is_impossible": True, "answers": []})
    return qas


def _unanswerable(rng: random.Random, facts: set[str]) -> str:
    missing = [f for f in OPTIONAL_FACTS if f not in facts]
    if missing and rng.random() < 0.5:  # a left-out fact's question
        fact = rng.choice(missing)
        return rng.choice([q for f, _, forms in QA_QUESTIONS if f == fact for q in forms[:-1]])
    return rng.choice(QA_UNANSWERABLE if "moved" in facts else QA_UNANSWERABLE[:-2])


def _vary_question(rng: random.Random, question: str) -> str:
    if rng.random() < 0.1:
        question = question.lower()
    return question[:-1] if rng.random() < 0.1 else question  # "?" dropped


def qa_split(split: str, n_contexts: int, seed: int = 0) -> dict:
    """SQuAD v2.0 JSON of `n_contexts` contexts (one article each), about 4.9 questions a context."""
    if n_contexts < 1:
        raise ValueError(f"n_contexts must be >= 1, got {n_contexts!r}")
    rng = random.Random(f"qa-{split}-{seed}")
    pools, articles = Pools.for_split(split), []
    for i in range(n_contexts):
        values = qa_values(rng, pools)
        context, facts, spans = qa_context(rng, values)
        qas = qa_questions(rng, values, facts, spans, split)
        for j, qa in enumerate(qas):
            qa["id"] = f"{split}-{i}-{j}"
        articles.append({"title": f"synthetic-{split}-{i}", "paragraphs": [{"context": context, "qas": qas}]})
    return {"version": "v2.0", "data": articles}


def write_qa(out_dir: str | os.PathLike, seed: int = 0, n_train: int = 800, n_test: int = 150) -> dict:
    """out_dir/qa-train.json and out_dir/qa-test.json (SQuAD v2.0); returns their paths and sizes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, str | int] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        squad = qa_split(split, n, seed)
        path = out_dir / f"qa-{split}.json"
        atomic_write_bytes(path, json.dumps(squad, indent=1).encode("utf-8"))
        result[split], result[f"{split}_contexts"] = str(path), n
        result[f"{split}_questions"] = sum(len(p["qas"]) for a in squad["data"] for p in a["paragraphs"])
    return result
