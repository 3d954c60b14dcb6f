"""Generated assistant commands with intents and slots: training data for the test heads.

Provenance: written for surge (no external data). Templates of spoken-assistant
commands (lights, timers, music, weather, messages, reminders, thermostat,
navigation) are filled with slot values from the word lists below, with a
seeded random generator, so the data set is reproducible and its labels exact:
each example has an intent and, per word, a BIO slot tag (B-room, I-room,
B-device, ...). Used by models/finetune.py to train the intent classifier and
the slot tagger that tests and benchmarks serve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ROOMS = ["kitchen", "living room", "bedroom", "bathroom", "garage", "office", "dining room", "hallway"]
DEVICES = ["lights", "lamp", "fan", "heater", "tv", "speaker", "air conditioner", "coffee machine"]
DURATIONS = ["five minutes", "ten minutes", "an hour", "thirty seconds", "two hours", "twenty minutes"]
ARTISTS = ["miles davis", "taylor swift", "the beatles", "nina simone", "daft punk", "bach", "radiohead"]
GENRES = ["jazz", "rock", "classical music", "hip hop", "lo-fi beats", "country"]
CITIES = ["paris", "new york", "tokyo", "berlin", "san francisco", "london", "mumbai", "sydney"]
DAYS = ["today", "tomorrow", "tonight", "this weekend", "on monday", "next week"]
PEOPLE = ["mom", "alice", "bob", "my boss", "grandpa", "sarah", "the team"]
TASKS = ["buy milk", "call the dentist", "water the plants", "pay rent", "pick up the kids", "book a table"]
TEMPS = ["twenty degrees", "seventy two degrees", "eighteen degrees", "sixty eight degrees"]
PLACES = ["the airport", "the nearest gas station", "work", "the train station", "central park"]

# intent -> templates; {slot} is filled from SLOTS[slot]
TEMPLATES = {
    "lights_on": ["turn on the {device} in the {room}", "switch on the {room} {device}", "please turn the {device} on",
                  "can you turn on the {device}", "{room} {device} on please"],
    "lights_off": ["turn off the {device} in the {room}", "switch off the {room} {device}", "shut off the {device}",
                   "kill the {device} in the {room}", "{device} off"],
    "set_timer": ["set a timer for {duration}", "start a {duration} timer", "timer for {duration} please",
                  "remind me in {duration}", "count down {duration}"],
    "play_music": ["play {artist}", "play some {genre}", "put on {genre} in the {room}", "i want to hear {artist}",
                   "play {artist} on the {device}"],
    "weather": ["what is the weather in {city} {day}", "will it rain {day}", "how hot is it in {city}",
                "weather forecast for {city}", "do i need an umbrella {day}"],
    "send_message": ["text {person} that i am late", "send a message to {person}", "tell {person} i will call back",
                     "message {person} {day}", "write to {person}"],
    "reminder": ["remind me to {task} {day}", "add a reminder to {task}", "don't let me forget to {task}",
                 "set a reminder {day} to {task}"],
    "thermostat": ["set the temperature to {temp}", "make the {room} {temp}", "set the thermostat to {temp} {day}",
                   "heat the {room} to {temp}"],
    "navigate": ["take me to {place}", "directions to {place}", "how do i get to {place} from {city}",
                 "navigate to {place}", "how long to drive to {place}"],
}
SLOTS = {"room": ROOMS, "device": DEVICES, "duration": DURATIONS, "artist": ARTISTS, "genre": GENRES, "city": CITIES,
         "day": DAYS, "person": PEOPLE, "task": TASKS, "temp": TEMPS, "place": PLACES}
INTENTS = tuple(TEMPLATES)
SLOT_TAGS = ("O",) + tuple(f"{p}-{s}" for s in SLOTS for p in ("B", "I"))


@dataclass(frozen=True)
class Example:
    text: str
    intent: str
    words: tuple[str, ...]
    tags: tuple[str, ...]  # one BIO tag per word


def _fill(template: str, rng: random.Random) -> tuple[list[str], list[str]]:
    words, tags = [], []
    for part in template.split():
        if part.startswith("{") and part.endswith("}"):
            slot = part[1:-1]
            value = rng.choice(SLOTS[slot]).split()
            words += value
            tags += [f"B-{slot}"] + [f"I-{slot}"] * (len(value) - 1)
        else:
            words.append(part)
            tags.append("O")
    return words, tags


def generate(n: int, seed: int = 0) -> list[Example]:
    """`n` examples, intents balanced, reproducible for a given seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        intent = INTENTS[i % len(INTENTS)]
        words, tags = _fill(rng.choice(TEMPLATES[intent]), rng)
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        out.append(Example(" ".join(words), intent, tuple(words), tuple(tags)))
    rng.shuffle(out)
    return out
