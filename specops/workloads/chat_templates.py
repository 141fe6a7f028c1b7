"""Chat request templates of the ``sql`` and ``math`` domains, and the chat prompt type.

``sql`` fills text-to-SQL questions over 14 table schemas (the Spider shape), ``math`` fills
grade-school word problems (the GSM8K shape); each template has many slots. The ``api``
domain and the assembly of a workload from these generators live in :mod:`specops.workloads.chat_workload`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM = {
    "sql": "You are a SQL assistant. Given a table schema and a question, answer with one SQLite query, "
    "then explain it in one sentence.",
    "math": "You are a patient math tutor. Solve the word problem step by step, then give the final answer "
    "on its own line.",
    "api": "You are a Python programming assistant. Explain what the function does, its main parameters, "
    "and show a short usage example.",
    "docs": "You are a technical writer. Rewrite the documentation the user gives you in plain words for "
    "someone new to the library: short sentences, no jargon left unexplained.",
}


@dataclass(frozen=True)
class ChatPrompt:
    """One chat request: its domain, where it came from, and its messages."""

    domain: str
    source: str
    messages: tuple[tuple[str, str], ...]
    """(role, content) pairs: system, then user."""

    @property
    def user(self) -> str:
        return self.messages[-1][1]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


# ------------------------------------------------------------------------------------- sql
# table: (rows noun plural, singular, columns [(name, type, kind)], categorical values)
# kind: "id", "num" (numeric), "text" (a name or title), "cat" (a category with values)
_SCHEMAS: dict[str, tuple[str, str, list[tuple[str, str, str]], dict[str, list[str]]]] = {
    "employees": (
        "employees",
        "employee",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("department", "TEXT", "cat"),
            ("salary", "REAL", "num"),
            ("hire_year", "INTEGER", "num"),
            ("manager_id", "INTEGER", "id"),
            ("city", "TEXT", "cat"),
        ],
        {
            "department": ["Sales", "Engineering", "Finance", "Support", "Legal", "Marketing"],
            "city": ["Berlin", "Austin", "Lagos", "Osaka", "Lima", "Oslo"],
        },
    ),
    "orders": (
        "orders",
        "order",
        [
            ("id", "INTEGER", "id"),
            ("customer", "TEXT", "text"),
            ("product", "TEXT", "cat"),
            ("quantity", "INTEGER", "num"),
            ("unit_price", "REAL", "num"),
            ("status", "TEXT", "cat"),
            ("order_year", "INTEGER", "num"),
        ],
        {
            "product": ["laptop", "monitor", "keyboard", "headset", "webcam", "dock"],
            "status": ["shipped", "pending", "returned", "cancelled", "delivered"],
        },
    ),
    "students": (
        "students",
        "student",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("major", "TEXT", "cat"),
            ("gpa", "REAL", "num"),
            ("enrollment_year", "INTEGER", "num"),
            ("credits", "INTEGER", "num"),
            ("advisor", "TEXT", "cat"),
        ],
        {
            "major": ["Physics", "History", "Biology", "Economics", "Computer Science", "Music"],
            "advisor": ["Dr. Okafor", "Dr. Lindqvist", "Dr. Tanaka", "Dr. Moreau", "Dr. Reyes"],
        },
    ),
    "flights": (
        "flights",
        "flight",
        [
            ("id", "INTEGER", "id"),
            ("flight_number", "TEXT", "text"),
            ("airline", "TEXT", "cat"),
            ("origin", "TEXT", "cat"),
            ("destination", "TEXT", "cat"),
            ("duration_minutes", "INTEGER", "num"),
            ("price", "REAL", "num"),
        ],
        {
            "airline": ["Aurora Air", "BlueJet", "Condor Lines", "SkyWays"],
            "origin": ["JFK", "LHR", "NRT", "CDG", "SYD", "GRU"],
            "destination": ["SFO", "DXB", "SIN", "FRA", "MEX", "JNB"],
        },
    ),
    "books": (
        "books",
        "book",
        [
            ("id", "INTEGER", "id"),
            ("title", "TEXT", "text"),
            ("author", "TEXT", "cat"),
            ("genre", "TEXT", "cat"),
            ("published_year", "INTEGER", "num"),
            ("pages", "INTEGER", "num"),
            ("rating", "REAL", "num"),
        ],
        {
            "author": ["Ursula Le Guin", "Chinua Achebe", "Jane Austen", "Haruki Murakami", "Toni Morrison"],
            "genre": ["fantasy", "mystery", "biography", "poetry", "science fiction", "romance"],
        },
    ),
    "movies": (
        "movies",
        "movie",
        [
            ("id", "INTEGER", "id"),
            ("title", "TEXT", "text"),
            ("director", "TEXT", "cat"),
            ("release_year", "INTEGER", "num"),
            ("box_office_millions", "REAL", "num"),
            ("runtime_minutes", "INTEGER", "num"),
            ("genre", "TEXT", "cat"),
        ],
        {
            "director": ["Agnes Varda", "Akira Kurosawa", "Bong Joon-ho", "Greta Gerwig", "Satyajit Ray"],
            "genre": ["drama", "comedy", "thriller", "animation", "documentary", "western"],
        },
    ),
    "patients": (
        "patients",
        "patient",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("age", "INTEGER", "num"),
            ("diagnosis", "TEXT", "cat"),
            ("ward", "TEXT", "cat"),
            ("days_admitted", "INTEGER", "num"),
            ("bill", "REAL", "num"),
        ],
        {
            "diagnosis": ["asthma", "fracture", "influenza", "diabetes", "migraine"],
            "ward": ["North", "South", "East", "Pediatrics", "Cardiology"],
        },
    ),
    "products": (
        "products",
        "product",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("category", "TEXT", "cat"),
            ("price", "REAL", "num"),
            ("stock", "INTEGER", "num"),
            ("supplier", "TEXT", "cat"),
            ("weight_kg", "REAL", "num"),
        ],
        {
            "category": ["garden", "kitchen", "toys", "sports", "office", "lighting"],
            "supplier": ["Acme", "Globex", "Initech", "Umbrella", "Soylent"],
        },
    ),
    "songs": (
        "songs",
        "song",
        [
            ("id", "INTEGER", "id"),
            ("title", "TEXT", "text"),
            ("artist", "TEXT", "cat"),
            ("album", "TEXT", "text"),
            ("duration_seconds", "INTEGER", "num"),
            ("plays", "INTEGER", "num"),
            ("release_year", "INTEGER", "num"),
        ],
        {"artist": ["Fela Kuti", "Bjork", "Nina Simone", "Radiohead", "Caetano Veloso"]},
    ),
    "cities": (
        "cities",
        "city",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("country", "TEXT", "cat"),
            ("population", "INTEGER", "num"),
            ("area_km2", "REAL", "num"),
            ("founded_year", "INTEGER", "num"),
            ("continent", "TEXT", "cat"),
        ],
        {
            "country": ["Brazil", "India", "Kenya", "Canada", "Japan", "Italy"],
            "continent": ["Africa", "Asia", "Europe", "North America", "South America"],
        },
    ),
    "matches": (
        "matches",
        "match",
        [
            ("id", "INTEGER", "id"),
            ("home_team", "TEXT", "cat"),
            ("away_team", "TEXT", "cat"),
            ("home_goals", "INTEGER", "num"),
            ("away_goals", "INTEGER", "num"),
            ("season", "INTEGER", "num"),
            ("attendance", "INTEGER", "num"),
            ("referee", "TEXT", "text"),
        ],
        {
            "home_team": ["Rovers", "United", "Athletic", "Wanderers", "City"],
            "away_team": ["Rangers", "Albion", "Town", "Dynamo", "Sporting"],
        },
    ),
    "restaurants": (
        "restaurants",
        "restaurant",
        [
            ("id", "INTEGER", "id"),
            ("name", "TEXT", "text"),
            ("cuisine", "TEXT", "cat"),
            ("city", "TEXT", "cat"),
            ("rating", "REAL", "num"),
            ("seats", "INTEGER", "num"),
            ("price_level", "INTEGER", "num"),
        ],
        {
            "cuisine": ["Thai", "Ethiopian", "Peruvian", "Korean", "Lebanese", "Italian"],
            "city": ["Lisbon", "Seoul", "Nairobi", "Toronto", "Melbourne"],
        },
    ),
    "vehicles": (
        "vehicles",
        "vehicle",
        [
            ("id", "INTEGER", "id"),
            ("plate", "TEXT", "text"),
            ("make", "TEXT", "cat"),
            ("model_year", "INTEGER", "num"),
            ("mileage_km", "INTEGER", "num"),
            ("fuel", "TEXT", "cat"),
            ("price", "REAL", "num"),
        ],
        {"make": ["Toyota", "Volvo", "Kia", "Ford", "Renault"], "fuel": ["petrol", "diesel", "electric", "hybrid"]},
    ),
    "sensors": (
        "sensor readings",
        "reading",
        [
            ("id", "INTEGER", "id"),
            ("sensor", "TEXT", "text"),
            ("location", "TEXT", "cat"),
            ("temperature_c", "REAL", "num"),
            ("humidity", "REAL", "num"),
            ("reading_hour", "INTEGER", "num"),
            ("status", "TEXT", "cat"),
        ],
        {"location": ["roof", "basement", "lab", "greenhouse", "warehouse"], "status": ["ok", "fault", "maintenance"]},
    ),
}

_SQL_QUESTIONS = (
    "How many {rows} have a {num} greater than {n}?",
    "List the {text} of every {row} whose {cat} is '{val}'.",
    "What is the average {num} of {rows} for each {cat}?",
    "Which {cat} has the highest total {num}?",
    "Show the {k} {rows} with the lowest {num}, together with their {text}.",
    "Find the {text} of {rows} whose {num} is between {a} and {b}, sorted by {num2} in descending order.",
    "How many distinct {cat} values appear among {rows} with a {num} below {n}?",
    "What are the largest and the smallest {num} of {rows} whose {cat} is not '{val}'?",
    "For each {cat}, count the {rows}, keeping only groups with more than {k} {rows}.",
    "Return the {text} and {num} of the {row} with the highest {num}.",
    "Which {rows} have a {text} that starts with the letter '{letter}'?",
    "What share of all {rows} have {cat} equal to '{val}'? Give it as a percentage.",
    "Give the total {num} of {rows} whose {cat} is '{val}' and whose {num2} is at least {n}.",
    "List each {cat} with its average {num}, from highest to lowest average.",
    "Are there any {rows} with a missing {text}? Show their id.",
    "Update-free question: what is the median-like middle {num} if we sort the {rows} by {num}? Use LIMIT and OFFSET.",
    "Show the {text}, {cat} and {num} of {rows} whose {num} is above the average {num} of all {rows}.",
    "How many {rows} per {cat} have a {num2} smaller than {n}?",
)
_LETTERS = "ABCDEGHKLMNPRST"


def sql_prompts(rng: random.Random, n: int) -> list[ChatPrompt]:
    out = []
    names = sorted(_SCHEMAS)
    for _ in range(n):
        table = rng.choice(names)
        rows, row, cols, cats = _SCHEMAS[table]
        nums = [c for c, _, k in cols if k == "num"]
        texts = [c for c, _, k in cols if k == "text"]
        catcols = [c for c, _, k in cols if k == "cat"]
        q = rng.choice(_SQL_QUESTIONS)
        num = rng.choice(nums)
        num2 = rng.choice([c for c in nums if c != num] or nums)
        cat = rng.choice(catcols)
        a = rng.randint(1, 500)
        fill = dict(
            rows=rows,
            row=row,
            num=num.replace("_", " "),
            num2=num2.replace("_", " "),
            text=rng.choice(texts).replace("_", " "),
            cat=cat.replace("_", " "),
            val=rng.choice(cats.get(cat, ["x"])),
            n=rng.choice([3, 5, 10, 12, 20, 50, 100, 250, 1000, 2015]),
            k=rng.choice([2, 3, 4, 5, 10]),
            a=a,
            b=a + rng.randint(5, 500),
            letter=rng.choice(_LETTERS),
        )
        schema = (
            f"CREATE TABLE {table} ("
            + ", ".join(f"{c} {t}{' PRIMARY KEY' if c == 'id' else ''}" for c, t, _ in cols)
            + ");"
        )
        user = f"Schema:\n{schema}\n\nQuestion: {q.format(**fill)}"
        out.append(ChatPrompt("sql", f"sql:{table}", (("system", SYSTEM["sql"]), ("user", user))))
    return out


# ------------------------------------------------------------------------------------ math
_NAMES = (
    "Amara",
    "Bilal",
    "Chen",
    "Dagny",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ines",
    "Jomo",
    "Kaito",
    "Leila",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sione",
    "Tariq",
    "Uma",
    "Viktor",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zofia",
    "Aiko",
    "Bruno",
    "Carmen",
    "Dmitri",
    "Elif",
    "Felix",
    "Greta",
    "Hugo",
    "Ivy",
    "Jonas",
    "Kemi",
    "Luca",
    "Mina",
    "Nikhil",
)
_ITEMS = (
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("notebook", "notebooks"),
    ("marble", "marbles"),
    ("sticker", "stickers"),
    ("cupcake", "cupcakes"),
    ("seashell", "seashells"),
    ("comic book", "comic books"),
    ("trading card", "trading cards"),
    ("tomato plant", "tomato plants"),
    ("bracelet", "bracelets"),
    ("stamp", "stamps"),
    ("candle", "candles"),
    ("puzzle", "puzzles"),
    ("balloon", "balloons"),
    ("cookie", "cookies"),
    ("toy car", "toy cars"),
    ("postcard", "postcards"),
)
_GOODS = ("bicycle", "video game", "telescope", "guitar", "pair of skates", "tablet", "tent", "microscope", "camera")
_MATH = (
    "{name} buys {a} {items} at ${p} each and pays with a ${bill} bill. How much change does {name} get?",
    "{name} has {a} {items}. {name} gives {b} of them to {name2} and then buys {c} more. How many {items} does {name} have now?",
    "A train travels {d} km in {h} hours. At the same speed, how far does it travel in {h2} hours?",
    "A rectangular garden is {w} m wide and {l} m long. What are its area and its perimeter?",
    "{name} saves ${a} every week. How many weeks will it take to save enough for a ${big} {good}?",
    "A recipe uses {a} cups of flour for {b} servings. How many cups of flour are needed for {c} servings?",
    "{name} reads {a} pages a day. The book has {big} pages. How many days does it take to finish the book?",
    "The price of a {good} rose from ${a} to ${big}. By what percentage did the price increase?",
    "{a} workers can paint a fence in {b} days. How many days would {c} workers take, working at the same rate?",
    "{name} ran {a} km on Monday, {b} km on Tuesday and {c} km on Wednesday. What was the average distance per day?",
    "A box holds {a} {items}. {name} has {big} {items}. How many boxes are needed, and how many {items} are left over in the last box?",
    "{name} is {a} years old. {name2} is {b} years older than {name}. How old will {name2} be in {c} years?",
    "A shop sells {items} at {c} for ${p}. How much do {big} {items} cost?",
    "{name} scored {a}, {b} and {c} points in three games. How many points are needed in the fourth game for an average of {d}?",
    "A tank holds {big} litres and fills at {a} litres per minute. How long does it take to fill it from empty?",
    "{name} shares {big} {items} equally among {a} friends and keeps the rest. How many does each friend get, and how many does {name} keep?",
    "A {good} costs ${big}. It is on sale for {pct}% off. What is the sale price?",
    "{name} walks {a} km to school and {b} km back home each day. How far does {name} walk in {c} school days?",
    "A class has {big} students. {pct}% of them bring lunch from home. How many students bring lunch?",
    "{name} bought {a} {items} and {b} times as many {items2}. How many items did {name} buy in total?",
)


def math_prompts(rng: random.Random, n: int) -> list[ChatPrompt]:
    out = []
    for _ in range(n):
        i = rng.randrange(len(_MATH))
        t = _MATH[i]
        name, name2 = rng.sample(_NAMES, 2)
        (_, items), (_, items2) = rng.sample(_ITEMS, 2)
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 30)
        fill = dict(
            name=name,
            name2=name2,
            items=items,
            items2=items2,
            a=a,
            b=b,
            c=c,
            p=rng.randint(2, 15),
            bill=rng.choice([50, 100, 200]),
            d=rng.randint(40, 900),
            h=rng.randint(2, 9),
            h2=rng.randint(2, 12),
            w=rng.randint(3, 40),
            l=rng.randint(5, 60),
            big=rng.randint(60, 900),
            good=rng.choice(_GOODS),
            pct=rng.choice([10, 15, 20, 25, 30, 40, 60, 75]),
        )
        out.append(ChatPrompt("math", f"math:t{i:02d}", (("system", SYSTEM["math"]), ("user", t.format(**fill)))))
    return out
