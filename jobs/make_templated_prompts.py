"""Write sample_data/templated_prompts.jsonl: chat rows of four dataset-style templated tasks
whose answers repeat in form but not in content, the kind of job a job-wide suffix index over
earlier completions (batchspec.decoding.suffix_index) speeds up.

Tasks, taking turns row by row so that any head of the file mixes them:
- person: extract a person's name, age and city from a sentence as JSON;
- review: label a product review positive or negative, with a one-sentence reason;
- order: rewrite an order note into a fixed "Product: ... | Quantity: ... | Ship to: ..." line;
- event: rewrite an event announcement as "Event: ...; Date: ...; Place: ...".

Deterministic: a fixed seed, so the file is reproduced exactly.

    .venv/bin/python jobs/make_templated_prompts.py [--rows 240] [--out sample_data/templated_prompts.jsonl]
"""

import argparse
import json
import random

FIRST_NAMES = """Maria Tom Aiko Lars Priya Diego Fatima Jonas Chen Olga Kwame Sofia Mateo Ingrid Ravi Leila
Noah Yuki Amara Pavel Elena Hassan Clara Tariq Mei Oskar Zainab Luca Greta Omar Hana Felix Nadia Arjun Rosa""".split()
LAST_NAMES = """Lopez Becker Tanaka Nilsson Sharma Garcia Haddad Weber Wei Ivanova Mensah Rossi Silva Berg Patel
Karimi Smith Sato Okafor Novak Petrova Aziz Dubois Khan Lin Lund Bello Romano Schulz Farouk Kim Wagner Rao""".split()
CITIES = """Valencia Hamburg Osaka Uppsala Pune Bogota Casablanca Leipzig Chengdu Kazan Accra Turin Porto
Bergen Jaipur Tabriz Denver Sapporo Lagos Brno Sofia Izmir Lyon Lahore Taipei Aarhus Kano Naples Graz Tunis Busan
Dresden Quito Perth Nantes""".split()
PERSON_SENTENCES = [
    "{name}, {age}, lives in {city} and works as a nurse.",
    "{name} is a {age}-year-old teacher from {city}.",
    "Born {age} years ago, {name} now runs a bakery in {city}.",
    "{name} ({age}) moved to {city} last spring to study music.",
    "At {age}, {name} still cycles to work every day in {city}.",
    "Our new neighbour {name} is {age} and grew up in {city}.",
]
PRODUCTS = """kettle; backpack; desk lamp; running shoes; blender; phone case; office chair; rain jacket;
coffee grinder; bike lock; yoga mat; electric toothbrush; headphones; frying pan; tent; water bottle;
keyboard; umbrella; air purifier; alarm clock""".replace("\n", " ").split("; ")
GOOD_POINTS = ["it works exactly as described", "the build quality is excellent", "it arrived a day early",
               "it is quiet and easy to clean", "the battery lasts for days", "it was worth every cent",
               "it feels sturdy and looks great", "setup took two minutes"]
BAD_POINTS = ["it broke after a week", "it is much smaller than the photos suggest", "it arrived scratched",
              "the instructions were useless", "it stopped charging after a month", "it is far too loud",
              "the zipper jammed on the first day", "support never answered my emails"]
QUANTITIES = ["one", "two", "three", "four", "five", "six", "a dozen", "ten"]
EVENTS = """book club meeting; charity run; jazz concert; farmers market; chess tournament; film night;
science fair; pottery workshop; beach cleanup; poetry reading; food festival; coding workshop""".replace(
    "\n", " "
).split("; ")
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["March", "April", "May", "June", "July", "September", "October", "November"]
VENUES = ["the town library", "Central Park", "the old harbour", "the community hall", "the city museum",
          "the university campus", "the main square", "the riverside pavilion"]


def person_prompt(rng: random.Random) -> str:
    """An extraction row: a sentence about one person, to be turned into JSON."""
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    sentence = rng.choice(PERSON_SENTENCES).format(name=name, age=rng.randint(19, 78), city=rng.choice(CITIES))
    return ("Extract the person from this sentence as JSON with the keys name, age and city. "
            f"Reply with the JSON only.\n\n{sentence}")


def review_prompt(rng: random.Random) -> str:
    """A classification row: a short product review, half of them positive, to label with a reason."""
    product = rng.choice(PRODUCTS)
    if rng.random() < 0.5:
        review = f"I bought this {product} for my flat and {rng.choice(GOOD_POINTS)}. Would buy again."
    else:
        review = f"This {product} was a disappointment: {rng.choice(BAD_POINTS)}. I want a refund."
    return ("Label this review positive or negative and give a one-sentence reason, in the form: "
            f"Label: X. Reason: ...\n\nReview: {review}")


def order_prompt(rng: random.Random) -> str:
    """A rewriting row: a chatty order note to put into one fixed line."""
    name, city = rng.choice(FIRST_NAMES), rng.choice(CITIES)
    quantity, product = rng.choice(QUANTITIES), rng.choice(PRODUCTS)
    note = f"Hi, this is {name}. Could you please send {quantity} {product}s to our office in {city}? Thanks!"
    return ("Rewrite this order in the form: Product: <product> | Quantity: <number> | Ship to: <city>\n\n"
            f"Order: {note}")


def event_prompt(rng: random.Random) -> str:
    """A rewriting row: an event announcement to restate in a fixed form."""
    event, venue = rng.choice(EVENTS), rng.choice(VENUES)
    date = f"{rng.choice(DAYS)} {rng.randint(1, 28)} {rng.choice(MONTHS)}"
    text = f"Join us for the {event} at {venue} on {date}, starting at {rng.randint(9, 19)}:00. Everyone is welcome!"
    return f"Rewrite this announcement in the form: Event: <name>; Date: <date>; Place: <place>\n\n{text}"


TASKS = {"person": person_prompt, "review": review_prompt, "order": order_prompt, "event": event_prompt}


def rows(count: int, seed: int) -> list[dict]:
    """`count` chat rows, the tasks taking turns, ids '<task>-<n>'."""
    rng = random.Random(seed)
    names = list(TASKS)
    out = []
    for i in range(count):
        task = names[i % len(names)]
        content = TASKS[task](rng)
        out.append({"id": f"{task}-{i // len(names) + 1:03d}", "messages": [{"role": "user", "content": content}]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--seed", type=int, default=76)
    parser.add_argument("--out", default="sample_data/templated_prompts.jsonl")
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for row in rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
