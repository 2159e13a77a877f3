"""A seeded world of invented entities: the corpus and the questions of the built-in ``search`` task.

Countries, cities, people and companies get invented names (syllables; no name token is a substring of
another, so cover-EM never confuses two of them), years and links to each other. Each entity has one
encyclopedic document; distractor documents (events that mention entities with other years, and family-name
pages listing namesakes) make the retriever's top results contain near misses. Every question asks a fact of
one entity whose answer is an invented name or a year that only the corpus holds, and the held-out split is a
fixed share of the entities: no question about a held-out entity is ever a training question.

Everything is a pure function of ``(seed, entities)``; ``WORLD_VERSION`` names the generator's revision.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from stoa.retrieval.base import Doc

__all__ = ["HELDOUT_SHARE", "WORLD_VERSION", "Question", "World", "build_world"]

WORLD_VERSION = 1
HELDOUT_SHARE = 0.15
"""Share of the entities whose questions form the held-out split."""

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st",
           "th", "sh", "tr", "vr", "sk")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "x", "m", "k")
_OCCUPATIONS = ("chemist", "painter", "cartographer", "composer", "engineer", "botanist", "poet", "astronomer",
                "architect", "sculptor", "physician", "historian", "glassblower", "shipwright", "linguist")
_PRODUCTS = ("clocks", "lanterns", "bicycles", "telescopes", "textiles", "ceramics", "typewriters", "maps",
             "pianos", "compasses", "paper", "soap")
_COMPANY_SUFFIX = ("Works", "Company", "Foundry", "Manufactory", "Guild", "Mills")
_EVENTS = ("Harbour Fair", "Lantern Festival", "Winter Congress", "Grand Exhibition", "River Regatta",
           "Scholars' Meeting", "Spring Market", "Music Contest")
_REGIONS = ("northern", "southern", "eastern", "western", "central")


@dataclass(frozen=True)
class Question:
    """One question of the world."""

    subject: str
    """Id of the entity asked about (the split is decided by it)."""
    text: str
    """The question."""
    golds: tuple[str, ...]
    """The gold answers (an invented name or a year; a river also by its name alone)."""
    steps: tuple[str, ...] = ()
    """A two-hop question's sub-questions in order (the first names the subject, the second the bridge entity
    its answer names); empty for a one-hop question, whose answer is on the subject's own page."""
    bridge: str = ""
    """Id of the entity a two-hop question's answer is on (empty for a one-hop question)."""


@dataclass(frozen=True)
class World:
    """The corpus and the questions of one ``(seed, entities)``."""

    docs: tuple[Doc, ...]
    train: tuple[Question, ...]
    test: tuple[Question, ...]
    entities: int
    """Entities generated (countries, cities, people, companies)."""
    heldout_entities: frozenset[str] = field(default_factory=frozenset)
    """Ids of the entities whose questions are held out."""


class _Namer:
    """Invented name tokens: unique, and none a substring of another (case-insensitive)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tokens: set[str] = set()
        self.pieces: set[str] = set()  # every substring of every token

    def _candidate(self, syllables: int) -> str:
        r = self.rng
        word = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables)) + r.choice(_CODAS)
        return word.capitalize()

    def new(self, syllables: int = 2, suffix: str = "") -> str:
        """A fresh token of about ``syllables`` syllables, ending in ``suffix``."""
        for _ in range(1000):
            word = self._candidate(syllables) + suffix
            low = word.lower()
            if not 5 <= len(low) <= 12 or low in self.pieces:
                continue
            subs = {low[i:j] for i in range(len(low)) for j in range(i + 1, len(low) + 1)}
            if subs & self.tokens:
                continue
            self.tokens.add(low)
            self.pieces |= subs
            return word
        return self.new(syllables + 1, suffix)  # pragma: no cover - the names of this length are exhausted


@dataclass
class _Entities:
    countries: list[dict[str, str | int]]
    cities: list[dict[str, str | int]]
    people: list[dict[str, str | int]]
    companies: list[dict[str, str | int]]


def _make_entities(rng: random.Random, namer: _Namer, entities: int) -> _Entities:
    n_countries = max(3, entities // 20)
    n_cities = max(6, entities // 5)
    n_companies = max(3, entities // 5)
    n_people = max(6, entities - n_countries - n_cities - n_companies)
    countries = [{"id": f"country-{i}", "name": namer.new(2, rng.choice(("ia", "land", "ar", "ovia"))),
                  "currency": namer.new(2), "year": rng.randint(1400, 1950), "region": rng.choice(_REGIONS)}
                 for i in range(n_countries)]
    cities = [{"id": f"city-{i}", "name": namer.new(2), "country": rng.randrange(n_countries),
               "river": namer.new(2), "year": rng.randint(900, 1800)} for i in range(n_cities)]
    for c, country in enumerate(countries):  # every capital is a city of its own country
        cities[c % n_cities]["country"] = c
        country["capital"] = c % n_cities
    surnames = [namer.new(2) for _ in range(max(3, n_people // 2))]
    first = [namer.new(2) for _ in range(max(3, n_people // 2))]
    seen: set[tuple[str, str]] = set()
    people: list[dict[str, str | int]] = []
    while len(people) < n_people:
        pair = (rng.choice(first), rng.choice(surnames))
        if pair in seen:
            continue
        seen.add(pair)
        people.append({"id": f"person-{len(people)}", "name": f"{pair[0]} {pair[1]}", "surname": pair[1],
                       "year": rng.randint(1700, 1960), "city": rng.randrange(n_cities),
                       "home": rng.randrange(n_cities), "job": rng.choice(_OCCUPATIONS)})
    companies: list[dict[str, str | int]] = []
    for i in range(n_companies):
        founder = rng.randrange(n_people)
        companies.append({"id": f"company-{i}", "name": f"{namer.new(2)} {rng.choice(_COMPANY_SUFFIX)}",
                          "founder": founder, "year": int(people[founder]["year"]) + rng.randint(20, 60),
                          "city": rng.randrange(n_cities), "product": rng.choice(_PRODUCTS)})
    return _Entities(countries, cities, people, companies)


def _s(x: str | int) -> str:
    return str(x)


def _a(noun: str) -> str:
    """The noun with its indefinite article."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _entity_docs(e: _Entities) -> list[Doc]:
    """One encyclopedic document per entity."""
    docs: list[Doc] = []
    for c in e.countries:
        cap = e.cities[int(c["capital"])]["name"]
        docs.append(Doc(_s(c["id"]), _s(c["name"]),
                        f"{c['name']} is a {c['region']} country. Its capital is {cap}, and it pays "
                        f"with the {c['currency']}. {c['name']} became independent in {c['year']}."))
    for c in e.cities:
        country = e.countries[int(c["country"])]["name"]
        docs.append(Doc(_s(c["id"]), _s(c["name"]),
                        f"{c['name']} is a city in {country}. It was founded in {c['year']} on the banks of the "
                        f"{c['river']} River, which flows through the old town."))
    for p in e.people:
        born, home = e.cities[int(p["city"])]["name"], e.cities[int(p["home"])]["name"]
        docs.append(Doc(_s(p["id"]), _s(p["name"]),
                        f"{p['name']} (born {p['year']} in {born}) is {_a(_s(p['job']))}. {p['surname']} later "
                        f"lived and worked in {home}."))
    for c in e.companies:
        founder, city = e.people[int(c["founder"])]["name"], e.cities[int(c["city"])]["name"]
        docs.append(Doc(_s(c["id"]), _s(c["name"]),
                        f"{c['name']} is a maker of {c['product']} with its headquarters in {city}. The "
                        f"company was founded in {c['year']} by {founder}."))
    return docs


def _distractor_docs(rng: random.Random, e: _Entities) -> list[Doc]:
    """Events naming entities with other years, and family-name pages listing namesakes."""
    docs: list[Doc] = []
    by_surname: dict[str, list[dict[str, str | int]]] = {}
    for p in e.people:
        by_surname.setdefault(_s(p["surname"]), []).append(p)
    for i, (surname, bearers) in enumerate(sorted(by_surname.items())):
        listed = "; ".join(f"{p['name']}, {_a(_s(p['job']))}" for p in bearers)
        docs.append(Doc(f"surname-{i}", f"{surname} (family name)",
                        f"{surname} is a family name. People with this name include {listed}."))
    n_events = len(e.people) + len(e.companies) + len(e.cities)
    for i in range(n_events):
        city = rng.choice(e.cities)
        guests = rng.sample(e.people, k=min(2, len(e.people)))
        firm = rng.choice(e.companies)
        year = rng.randint(1750, 1990)
        title = f"{year} {city['name']} {rng.choice(_EVENTS)}"
        docs.append(Doc(f"event-{i}", title,
                        f"The {title} was held in {city['name']} in {year}. Among the guests were "
                        f"{guests[0]['name']} and {guests[-1]['name']}; {firm['name']} showed its "
                        f"{firm['product']}."))
    return docs


def _questions(e: _Entities) -> list[Question]:
    """Every question the world asks, grouped by subject entity."""
    qs: list[Question] = []
    for c in e.countries:
        qs.append(Question(_s(c["id"]), f"What is the capital of {c['name']}?",
                           (_s(e.cities[int(c["capital"])]["name"]),)))
        qs.append(Question(_s(c["id"]), f"What currency is used in {c['name']}?", (_s(c["currency"]),)))
    for c in e.cities:
        qs.append(Question(_s(c["id"]), f"In what year was the city of {c['name']} founded?", (_s(c["year"]),)))
        qs.append(Question(_s(c["id"]), f"Which river flows through {c['name']}?",
                           (f"{c['river']} River", _s(c["river"]))))
    for p in e.people:
        qs.append(Question(_s(p["id"]), f"In what year was {p['name']} born?", (_s(p["year"]),)))
        qs.append(Question(_s(p["id"]), f"In which city was {p['name']} born?",
                           (_s(e.cities[int(p["city"])]["name"]),)))
    for c in e.companies:
        qs.append(Question(_s(c["id"]), f"Who founded {c['name']}?", (_s(e.people[int(c["founder"])]["name"]),)))
        qs.append(Question(_s(c["id"]), f"In what year was {c['name']} founded?", (_s(c["year"]),)))
        qs.append(Question(_s(c["id"]), f"In which city is {c['name']} headquartered?",
                           (_s(e.cities[int(c["city"])]["name"]),)))
    return qs


def _two_hop_questions(e: _Entities) -> list[Question]:
    """Questions whose answer sits on a second entity's page, named only on the subject's page: the founder's
    birth year (the subject's page holds a distracting year of its own), the capital's river, the country of a
    birth city or of a headquarters."""
    qs: list[Question] = []
    for c in e.countries:
        cap = e.cities[int(c["capital"])]
        qs.append(Question(_s(c["id"]), f"Which river flows through the capital of {c['name']}?",
                           (f"{cap['river']} River", _s(cap["river"])),
                           (f"What is the capital of {c['name']}?", f"Which river flows through {cap['name']}?"),
                           _s(cap["id"])))
    for p in e.people:
        city = e.cities[int(p["city"])]
        qs.append(Question(_s(p["id"]), f"In which country was {p['name']} born?",
                           (_s(e.countries[int(city["country"])]["name"]),),
                           (f"In which city was {p['name']} born?", f"In which country is {city['name']}?"),
                           _s(city["id"])))
    for c in e.companies:
        founder, city = e.people[int(c["founder"])], e.cities[int(c["city"])]
        qs.append(Question(_s(c["id"]), f"In what year was the founder of {c['name']} born?",
                           (_s(founder["year"]),),
                           (f"Who founded {c['name']}?", f"In what year was {founder['name']} born?"),
                           _s(founder["id"])))
        qs.append(Question(_s(c["id"]), f"In which country is {c['name']} headquartered?",
                           (_s(e.countries[int(city["country"])]["name"]),),
                           (f"In which city is {c['name']} headquartered?", f"In which country is {city['name']}?"),
                           _s(city["id"])))
    return qs


def build_world(seed: int, entities: int, hops: int = 1) -> World:
    """The world of this seed and size.

    Args:
        seed: the generator's seed.
        entities: about how many entities (at least 20).
        hops: 1: every question is about one entity's page; 2: two-hop questions too (``_two_hop_questions``).
            The corpus and the held-out entities are the same for both. A two-hop question is held out when its
            subject is (its bridge may be a training entity); a training one needs both its subject and its
            bridge outside the held-out entities, so no demonstration ever shows a held-out entity's page.
    """
    rng = random.Random(f"stoa.tasks.world|v{WORLD_VERSION}|{seed}|{entities}")
    e = _make_entities(rng, _Namer(rng), entities)
    docs = _entity_docs(e) + _distractor_docs(rng, e)
    subjects = [_s(x["id"]) for group in (e.countries, e.cities, e.people, e.companies) for x in group]
    n_held = max(1, round(HELDOUT_SHARE * len(subjects)))
    held = frozenset(rng.sample(subjects, k=n_held))
    qs = _questions(e) + (_two_hop_questions(e) if hops >= 2 else [])
    train = [q for q in qs if q.subject not in held and q.bridge not in held]
    test = [q for q in qs if q.subject in held]
    rng.shuffle(train)
    rng.shuffle(test)
    return World(docs=tuple(docs), train=tuple(train), test=tuple(test), entities=len(subjects),
                 heldout_entities=held)
