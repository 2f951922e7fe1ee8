"""Chat-like prompts built offline: everyday requests of the kinds chat assistants are asked (writing, role-play,
reasoning, math, extraction, science, humanities, advice), filled from topics the target lists itself. The
target's answers to them are training data in the prose a chat user reads, beside the standard library's code
tasks (training/data.py), which teach code and the target's way of explaining it.

Why this shape: a small target sampled from its chat template's user prefix (Magpie, Xu et al. 2024) wrote noisy
prompts when measured on the 1.5B default (questions about itself, both sides of a dialogue, other languages, about
3 s each); asked for a plain list of topics it writes clean ones, 48 lists (about 750 topics) in 1.5 minutes. The
templates are ours and generic; numbers in math and reasoning tasks come from a seeded random generator, so every
run builds the same prompts. No public benchmark goes in (we measure on them): no template paraphrases a HumanEval
or MT-bench question, and 2,000 built prompts share no word 8-gram with them (docs/benchmarks/chat_prompt_check.py).

The listed topics are written to a file once and read back on resume, so the training texts keep their order."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from specdecode.config import SamplingParams
from specdecode.models.loader import LoadedModel
from specdecode.training.answers import Answerer
from specdecode.training.data import TrainingText

TOPICS_FILE = "chat_topics.json"
TOPICS_PER_LIST = 30
LIST_SAMPLES = 4  # lists sampled per kind of topic
LIST_TEMPERATURE = 0.7
LIST_TOKENS = 200  # a list of 30 short names, most of the time
MAX_TOPIC_WORDS = 6
MAX_REPEATS = 1000  # repeats drawn in a row before the prompts end (math tasks alone rarely repeat)
# What the target is asked to list, by the name templates use (LIST_PROMPT).
TOPIC_REQUESTS = {
    "place": "cities, regions or natural places people like to visit",
    "job": "jobs and professions",
    "hobby": "hobbies and free-time activities",
    "science": "concepts from physics, chemistry, biology and astronomy",
    "history": "important events and periods from world history",
    "debate": "topics people commonly debate, such as policies or lifestyle choices",
    "food": "dishes and foods from around the world",
    "object": "everyday objects found in a home",
    "work": "common situations and challenges at work",
    "art": "famous novels, films, paintings and pieces of music",
    "name": "first names from different countries",
    "business": "kinds of small businesses",
}
LIST_PROMPT = ("List {count} {request}. Write one per line, each just a few words, with no numbering, no "
               "descriptions and nothing else.")

# Templates by kind of request; each names the topic lists it draws from.
TEMPLATES = {
    "writing": [
        "Describe the history and culture of {place} for someone who has never been there.",
        "Write a letter to a local newspaper arguing one side of {debate}.",
        "Write a poem about {object}.",
        "Write a short story in which a {job} has to deal with {work}.",
        "Write a short speech for a team meeting about {work} and how the team can overcome it.",
        "Write a product description for a new kind of {object}.",
        "Write an advertisement for a {business} in {place}.",
    ],
    "roleplay": [
        "Pretend you are a {job}. Describe a typical day at work, in the first person.",
        "Act as a tour guide in {place} and welcome a group of visitors.",
        "You are {name}, who has just taken up {hobby}. Tell a friend how the first week went.",
        "Imagine you are a chef. Explain to a new cook how you make {food}.",
    ],
    "science": [
        "Explain {science} to a high-school student, with an everyday example.",
        "What is {science}, and why does it matter? Answer in a few paragraphs.",
        "Compare {science} and {science2}: how are they related and how do they differ?",
    ],
    "humanities": [
        "What were the causes and consequences of {history}?",
        "Summarize the main arguments for and against {debate}.",
        "Why is {art} considered important? Discuss its themes and influence.",
        "How did {history} change everyday life for ordinary people?",
    ],
    "advice": [
        "Give me five practical tips for getting started with {hobby}.",
        "I am a {job} and I keep running into {work}. What should I do?",
        "How can I start a {business} on a small budget? Give a step-by-step plan.",
        "What should I pack and plan for a week in {place}?",
    ],
}


def list_topics(answerer: Answerer) -> dict[str, list[str]]:
    """LIST_SAMPLES sampled lists for each TOPIC_REQUESTS entry (seeds 0, 1, ...: the same lists on every run of
    the same target), cleaned: bullets, numbers and quotes dropped, at most MAX_TOPIC_WORDS words, no repeats (a
    small target asked greedily loops over a few; sampled lists measured far more varied), a list cut at its token
    cap losing its last, unfinished item."""
    tokenizer = answerer.engine.target.tokenizer
    prompt = {name: answerer.prompt_ids(LIST_PROMPT.format(count=TOPICS_PER_LIST, request=request))
              for name, request in TOPIC_REQUESTS.items()}
    asked = [(name, seed) for name in TOPIC_REQUESTS if prompt[name] is not None for seed in range(LIST_SAMPLES)]
    lists = answerer.complete([prompt[name] for name, _ in asked],
                              [SamplingParams(temperature=LIST_TEMPERATURE, max_tokens=answerer.answer_tokens,
                                              seed=seed) for _, seed in asked])
    topics: dict[str, list[str]] = {name: [] for name in TOPIC_REQUESTS}
    for (name, _), (ids, ended) in zip(asked, lists):
        # One per line as asked, or (as the 1.5B default often answers) separated by commas.
        items = re.split(r"[\n,;]", tokenizer.decode(ids))
        for item in items if ended else items[:-1]:
            topic = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", item).strip().strip("*\"'").strip().rstrip(".")
            if topic and len(topic.split()) <= MAX_TOPIC_WORDS and topic.lower() not in map(str.lower, topics[name]) \
                    and re.fullmatch(r"[\w\s'’&()./-]+", topic):
                topics[name].append(topic)
    return topics


def _math_task(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
    return rng.choice([
        f"Solve for x: {a}x + {b} = {a * c + b}. Show each step.",
        f"A shop sells notebooks at ${c} each and pens at ${rng.randint(1, 5)} each. If Sam buys {a} notebooks and "
        f"{b} pens, how much does he spend? Explain your reasoning.",
        f"A train travels {a * 10} km in {c} hours. What is its average speed, and how long would {b * 10} km "
        "take at that speed?",
        f"What is the sum of all integers from 1 to {a * 5}? Explain the method.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"If {c} people each shake hands once with every other person, how many handshakes are there? Explain.",
        f"A bag holds {a} red and {b} blue marbles. Two are drawn without putting the first back. What is the "
        "probability that both are red?",
        f"The price of a jacket is ${a * 5}. It is discounted by {c * 5}% and then taxed at 8%. What is the final "
        "price?",
    ])


def _reasoning_task(rng: random.Random, names: list[str]) -> str:
    x, y, z = rng.sample(names, 3) if len(names) >= 3 else ("Ana", "Ben", "Chen")
    age = rng.randint(8, 40)
    return rng.choice([
        f"{x} is {rng.randint(2, 9)} years older than {y}, and {y} is twice as old as {z}. If {z} is {age // 2} "
        "years old, how old are the others? Explain step by step.",
        f"{x}, {y} and {z} finished a race. {x} was not first, and {z} finished right after {x}. Who won? "
        "Explain your reasoning.",
        f"If all of {x}'s friends like music and {y} is one of {x}'s friends, what can we conclude about {y}? "
        "What can we not conclude?",
        f"{x} has {age} apples and gives a third of them to {y}, who eats two and gives half of the rest to {z}. "
        "How many apples does each have now?",
    ])


def _extraction_task(rng: random.Random, topics: dict[str, list[str]]) -> str:
    """Needs names, jobs and places listed (chat_prompts leaves it out otherwise)."""
    people = rng.sample(topics["name"], min(3, len(topics["name"])))
    rows = [f"{person} ({rng.randint(21, 64)}) works as a {rng.choice(topics['job']).lower()} "
            f"in {rng.choice(topics['place'])}" for person in people]
    text = ". ".join(rows) + "."
    return rng.choice([
        f"Extract each person's name, age, job and city from the text below and return them as JSON.\n\n{text}",
        f"Turn the following text into a table with columns name, age, job and city.\n\n{text}",
        f"Read the text and answer: who is the oldest, and where do they work?\n\n{text}",
    ])


def chat_prompts(topics: dict[str, list[str]], seed: int = 0) -> Iterator[TrainingText]:
    """Distinct chat prompts, the kinds taken in turn (so any budget gets a mix), each drawn with one seeded
    generator: the same sequence for the same topics. A prompt is held out by a hash of its ordinal's name."""
    rng = random.Random(seed)
    makers: list[Callable[[], str]] = [lambda kind=kind: _fill(rng.choice(TEMPLATES[kind]), topics, rng)
                                       for kind in TEMPLATES if _usable(TEMPLATES[kind], topics)]
    makers.append(lambda: _math_task(rng))
    makers.append(lambda: _reasoning_task(rng, topics.get("name", [])))
    if topics.get("name") and topics.get("job") and topics.get("place"):
        makers.append(lambda: _extraction_task(rng, topics))
    seen: set[str] = set()
    ordinal, repeats = 0, 0
    for make in itertools.cycle(makers):
        text = make()
        if text in seen:  # a repeat teaches nothing new; where the topics run out, the prompts end
            repeats += 1
            if repeats > MAX_REPEATS:
                return
            continue
        seen.add(text)
        repeats = 0
        yield TrainingText(f"chat-{ordinal}", text, "chat")
        ordinal += 1


def _fields(template: str) -> list[str]:
    return re.findall(r"{(\w+?)2?}", template)


def _usable(templates: list[str], topics: dict[str, list[str]]) -> bool:
    return all(len(topics.get(field, [])) >= 2 for template in templates for field in _fields(template))


def _fill(template: str, topics: dict[str, list[str]], rng: random.Random) -> str:
    values = {}
    for field in dict.fromkeys(_fields(template)):  # in the template's order: a set's order changes between runs
        first, second = rng.sample(topics[field], 2)
        values[field], values[field + "2"] = first, second
    return template.format(**values)


def chat_topics(target: LoadedModel, folder: Path) -> dict[str, list[str]]:
    """The target's topic lists, written to folder/chat_topics.json the first time (read back after)."""
    path = folder / TOPICS_FILE
    if path.exists():
        return json.loads(path.read_text())
    topics = list_topics(Answerer(target, LIST_TOKENS))
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(topics, indent=1, ensure_ascii=False))
    partial.replace(path)
    return topics
