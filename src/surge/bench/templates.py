"""Templates and slot values for short, assistant-style queries.

Written for surge's benchmarks (no external data). Lengths follow what voice and
chat assistants see: most queries are 3-12 words, with a tail of longer,
multi-clause requests (the LONG templates and the optional prefixes/suffixes).
"""

from __future__ import annotations

SLOTS: dict[str, list[str]] = {
    "city": ["paris", "london", "tokyo", "new york", "berlin", "madrid", "rome", "seattle", "chicago", "boston",
             "austin", "denver", "toronto", "sydney", "mumbai", "seoul", "lisbon", "dublin", "oslo", "cairo",
             "nairobi", "lima", "mexico city", "san francisco", "los angeles", "miami", "vienna", "prague",
             "amsterdam", "zurich", "singapore", "bangkok", "istanbul", "athens", "warsaw", "helsinki"],
    "day": ["today", "tomorrow", "tonight", "this weekend", "on monday", "on tuesday", "on wednesday",
            "on thursday", "on friday", "on saturday", "on sunday", "next week", "this afternoon"],
    "room": ["kitchen", "living room", "bedroom", "bathroom", "office", "garage", "hallway", "basement",
             "dining room", "kids room", "porch", "attic"],
    "device": ["lights", "lamp", "fan", "heater", "air conditioner", "tv", "speaker", "blinds", "thermostat",
               "coffee maker", "dishwasher", "vacuum"],
    "action": ["turn on", "turn off", "dim", "switch off", "switch on", "brighten"],
    "minutes": ["one", "two", "three", "five", "seven", "ten", "twelve", "fifteen", "twenty", "twenty five",
                "thirty", "forty five", "ninety"],
    "time": ["6 am", "6:30 am", "7 am", "7:15 am", "8 am", "9 am", "noon", "1 pm", "3 pm", "5 pm", "6 pm",
             "7:30 pm", "9 pm", "10 pm", "midnight"],
    "artist": ["taylor swift", "the beatles", "miles davis", "beyonce", "radiohead", "adele", "daft punk",
               "nina simone", "coldplay", "kendrick lamar", "bach", "fleetwood mac", "billie eilish",
               "bob marley", "queen", "norah jones", "the weeknd", "johnny cash", "bts", "shakira"],
    "genre": ["jazz", "classical music", "lo-fi beats", "rock", "hip hop", "country", "reggae", "techno",
              "blues", "folk", "ambient music", "pop hits", "k-pop", "salsa"],
    "person": ["mom", "dad", "alex", "sam", "maria", "john", "priya", "chen", "my boss", "my sister",
               "my brother", "grandma", "the dentist", "lucas", "emma", "noah"],
    "task": ["buy milk", "call the bank", "pay rent", "water the plants", "take out the trash", "pick up the kids",
             "book a haircut", "renew my passport", "send the report", "walk the dog", "charge the car",
             "return the library books", "order a birthday gift", "check the mail"],
    "food": ["lasagna", "pancakes", "chicken curry", "banana bread", "guacamole", "tomato soup", "pad thai",
             "chocolate chip cookies", "risotto", "a caesar salad", "fried rice", "shakshuka", "chili",
             "apple pie", "hummus"],
    "item": ["eggs", "bread", "coffee", "paper towels", "oat milk", "bananas", "dish soap", "rice", "olive oil",
             "batteries", "toothpaste", "cat food", "yogurt", "tortillas"],
    "amount": ["2", "3", "5", "10", "12", "20", "25", "50", "100", "250", "1000"],
    "unit_pair": ["miles to kilometers", "pounds to kilograms", "cups to milliliters", "fahrenheit to celsius",
                  "inches to centimeters", "ounces to grams", "feet to meters", "gallons to liters",
                  "dollars to euros", "euros to yen"],
    "team": ["the lakers", "real madrid", "the yankees", "manchester united", "the warriors", "the patriots",
             "barcelona", "the cubs", "liverpool", "the red sox", "the chiefs", "arsenal"],
    "topic": ["black holes", "the french revolution", "photosynthesis", "the stock market", "climate change",
              "the roman empire", "quantum computing", "volcanoes", "the immune system", "jazz history",
              "electric cars", "the moon landing", "machine learning", "honey bees", "the great wall of china"],
    "language": ["spanish", "french", "german", "japanese", "italian", "portuguese", "mandarin", "korean"],
    "phrase": ["good morning", "where is the train station", "thank you very much", "how much does this cost",
               "i would like a coffee", "nice to meet you", "see you tomorrow", "i am lost", "happy birthday",
               "the bill please"],
    "place": ["the airport", "the nearest gas station", "work", "home", "the closest pharmacy", "the beach",
              "a coffee shop", "the train station", "the hospital", "the gym", "downtown", "the mall"],
    "app": ["spotify", "the calendar", "my email", "maps", "the camera", "settings", "netflix", "whatsapp"],
}

# (template, weight): short everyday commands are most common.
SHORT: list[str] = [
    "what's the weather {day}",
    "weather in {city} {day}",
    "will it rain in {city} {day}",
    "{action} the {room} {device}",
    "{action} the {device}",
    "set a timer for {minutes} minutes",
    "set an alarm for {time}",
    "wake me up at {time} {day}",
    "play {artist}",
    "play some {genre}",
    "call {person}",
    "text {person} i'm running late",
    "remind me to {task}",
    "remind me to {task} {day}",
    "add {item} to my shopping list",
    "how do i make {food}",
    "convert {amount} {unit_pair}",
    "what time is it in {city}",
    "did {team} win",
    "when do {team} play next",
    "translate {phrase} to {language}",
    "directions to {place}",
    "how long to get to {place}",
    "open {app}",
    "tell me about {topic}",
    "what's on my calendar {day}",
    "pause the music",
    "skip this song",
    "what's the news {day}",
    "how far is {city} from {city2}",
]

MEDIUM: list[str] = [
    "can you {action} the {device} in the {room}",
    "what's the weather going to be like in {city} {day}",
    "remind me to {task} at {time} {day}",
    "set an alarm for {time} and {action} the {room} {device}",
    "play something by {artist} on the {room} speaker",
    "send a message to {person} saying i'll be home by {time}",
    "how many calories are in {food}",
    "what's a good recipe for {food} that takes under {minutes} minutes",
    "how do you say {phrase} in {language}",
    "what's the fastest way to get to {place} right now",
    "add {item} and {item2} to the grocery list",
    "how did {team} do last night",
    "explain {topic} like i'm five",
    "is it going to be colder in {city} or {city2} {day}",
    "schedule a call with {person} {day} at {time}",
]

LONG: list[str] = [
    "i'm planning a trip to {city} {day}, what should i pack and will i need an umbrella",
    "can you give me a short summary of {topic} and why it matters, in a few sentences",
    "i have {item}, {item2} and rice at home, what can i cook for dinner in about {minutes} minutes",
    "remind me {day} at {time} to {task} and also to call {person} after that",
    "what's the difference between {topic} and {topic2}, and which one should i read about first",
    "find me a quiet {genre} playlist for working and turn off the {device} in the {room}",
]

PREFIXES = ["", "", "", "", "", "hey ", "please ", "can you ", "could you ", "ok so ", "quick question, "]
SUFFIXES = ["", "", "", "", "", "", " please", " thanks", " right now", " for me", " again", "?"]

# Relative frequency of each template family.
FAMILY_WEIGHTS = {"short": 0.62, "medium": 0.30, "long": 0.08}
