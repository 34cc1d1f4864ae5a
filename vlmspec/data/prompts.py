"""Prompt banks of the data engine (`vlmspec data`): topics, templated text instructions, follow-up
turns that refer to the answer before them, and questions about photographs; and the one check
that keeps the held-out prompts out of any training corpus.

    TOPICS                       # what the instructions are about (cooking, black holes, tax forms, ...)
    text_prompt(rng)             # a templated instruction about a topic ("Explain how volcanoes work ...")
    followup_turns(rng, topic, n)  # n later user turns that refer to the earlier answer
    photo_question(rng)          # (kind, question) about a photograph: describe, count, colours, ...
    is_heldout(prompt)           # one of `heldout.TEXT_PROMPTS` / `heldout.PHOTO_QUESTIONS`, up to case and spacing

Nothing here appears in the held-out sets (`vlmspec.data.heldout`); `tests/test_data_engine.py`
checks every template against them.
"""

from __future__ import annotations

import random

from vlmspec.data.heldout import DESCRIBE_PHOTO, FOLLOWUP_QUESTIONS, PHOTO_QUESTIONS, TEXT_PROMPTS

TOPICS = (
    # everyday life
    "cooking pasta", "baking bread", "meal planning", "grocery budgeting", "houseplants", "vegetable gardening", "composting",
    "cleaning a kitchen", "moving to a new city", "renting an apartment", "job interviews", "writing a resume", "time management",
    "morning routines", "learning to drive", "bicycle maintenance", "camping", "hiking safety", "packing for a trip",
    "travelling on a budget", "learning a new language", "public speaking", "saving money", "credit cards", "paying taxes",
    "first aid", "healthy sleep", "stretching", "running a first 5k", "drinking enough water", "caring for a dog",
    "adopting a cat", "keeping fish", "birthday parties", "wedding speeches", "writing a thank-you letter", "making friends",
    "remote work", "email etiquette", "negotiating a salary",
    # science and nature
    "black holes", "the solar system", "photosynthesis", "volcanoes", "earthquakes", "climate change", "ocean tides",
    "the water cycle", "DNA", "vaccines", "the human heart", "bees and pollination", "dinosaurs", "evolution",
    "electricity", "magnets", "rainbows", "the periodic table", "gravity", "the speed of light", "weather forecasts",
    "coral reefs", "rainforests", "deserts", "migrating birds", "the moon's phases", "recycling plastic", "renewable energy",
    # technology
    "how the internet works", "password security", "machine learning", "spreadsheets", "writing Python functions",
    "sorting algorithms", "databases", "smartphone batteries", "3D printing", "electric cars", "GPS navigation",
    "cloud storage", "video compression", "open-source software", "keyboard shortcuts", "debugging code", "version control",
    "web browsers", "robots", "solar panels",
    # culture, history and society
    "the Roman Empire", "ancient Egypt", "the printing press", "the Renaissance", "the Industrial Revolution",
    "the history of jazz", "learning the guitar", "classical music", "writing poetry", "science fiction novels",
    "chess openings", "football tactics", "the Olympic Games", "museums", "architecture", "photography", "painting with watercolours",
    "knitting", "board games", "film editing", "democracy", "supply and demand", "inflation", "small businesses",
    "volunteering", "city planning", "public libraries", "world cuisines", "tea ceremonies", "festivals around the world",
    # school subjects
    "fractions", "percentages", "the Pythagorean theorem", "probability", "prime numbers", "essay structure", "grammar",
    "persuasive writing", "reading comprehension", "map reading", "basic statistics", "geometry", "algebra", "logic puzzles",
)

# templated instructions about a topic: the text source's fallback, and the first turn of a follow-up dialogue
TEXT_TEMPLATES = (
    "Explain {topic} to a beginner.",
    "Give me three key facts about {topic}.",
    "What are the most common mistakes people make with {topic}?",
    "Write a short paragraph about {topic}.",
    "List the main steps involved in {topic}.",
    "What should I know before getting started with {topic}?",
    "Describe the basic ideas behind {topic}.",
    "Why does {topic} matter?",
    "Summarize what {topic} is in a few sentences.",
    "Give some practical tips about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short story that involves {topic}.",
    "How would you teach {topic} to a ten-year-old?",
    "Compare two different approaches to {topic}.",
    "What questions do people often ask about {topic}?",
    "Make a simple plan for learning about {topic}.",
)

# later user turns: they refer to the answer before them (generic), or to the dialogue's topic
FOLLOWUPS = (
    "Explain that more simply.",
    "Can you give an example of the second point?",
    "Can you make that shorter?",
    "Why is that?",
    "Can you expand on the first point?",
    "Summarize your answer in one sentence.",
    "What is the most important part of what you said?",
    "Can you put that as a numbered list?",
    "Are there any exceptions to that?",
    "How would I explain that to a child?",
    "Give me one more tip.",
    "What did you mean by the last part?",
    "Can you say that in a friendlier tone?",
    "Is there anything you left out?",
    "Thanks! What should I do next?",
    "Can you give a real-world example?",
)
TOPIC_FOLLOWUPS = (
    "How does that relate to {topic} in everyday life?",
    "What is a common misconception about {topic}?",
    "Where can I learn more about {topic}?",
    "How has {topic} changed over time?",
    "What would an expert in {topic} add to your answer?",
)
PHOTO_FOLLOWUPS = (
    "What else can you see in the picture?",
    "Describe the colours in more detail.",
    "What is in the background?",
    "Can you describe it in one sentence?",
    "What might happen next in this scene?",
    "Which part of the picture stands out the most?",
)

# questions about a photograph, by kind; "open" ones are what the default model was not aligned for
PHOTO_QUESTIONS_BY_KIND = {
    "describe": (
        "Describe this image.", "Describe the photo in detail.", "What do you see in this picture?",
        "Give a short caption for this photo.", "Write a one-sentence description of the image.",
        "What is shown in this photograph?", "Describe the scene.",
    ),
    "count": (
        "How many animals are in the picture?", "How many people can you see?", "Count the main objects in this photo.",
        "How many distinct things are in the image?",
    ),
    "colours": (
        "What colours are in this image?", "What is the main colour of the photo?", "Describe the colours you see.",
        "Is the picture bright or dark?",
    ),
    "happening": (
        "What is happening in this picture?", "What is the subject doing?", "What is going on in this photo?",
        "Is anything moving in this image?",
    ),
    "open": (
        "Where might this photo have been taken?", "What time of day does it look like?", "Is this indoors or outdoors?",
        "Write a short poem inspired by this picture.", "What would be a good title for this photo?",
        "What mood does this image create?", "Which animal is in the photo, and how can you tell?", "Would this make a good postcard? Why?",
        "What might be just outside the frame?", "Tell a short story about this picture.",
    ),
}
PHOTO_KINDS = tuple(PHOTO_QUESTIONS_BY_KIND)


def prompt_key(prompt: str) -> str:
    """A prompt up to case, spacing and final punctuation (what counts as the same prompt)."""
    return " ".join(prompt.lower().split()).rstrip(" .?!")


HELDOUT_KEYS = frozenset(prompt_key(p) for p in (*TEXT_PROMPTS, *PHOTO_QUESTIONS, *FOLLOWUP_QUESTIONS, DESCRIBE_PHOTO))


def is_heldout(prompt: str) -> bool:
    """Whether `prompt` is one of the held-out prompts (never in training data)."""
    return prompt_key(prompt) in HELDOUT_KEYS


def text_prompt(rng: random.Random, topic: str | None = None) -> tuple[str, str]:
    """(topic, templated instruction about it)."""
    topic = topic or rng.choice(TOPICS)
    return topic, rng.choice(TEXT_TEMPLATES).format(topic=topic)


def followup_turns(rng: random.Random, topic: str | None, n: int, photo: bool = False) -> list[str]:
    """`n` distinct later user turns: generic ones that refer to the answer before them, one in
    four about the dialogue's `topic` when it has one, photo ones for a dialogue about a picture."""
    pool = list(FOLLOWUPS) + (list(PHOTO_FOLLOWUPS) * 2 if photo else [])
    turns: list[str] = []
    while len(turns) < n:
        if topic and rng.random() < 0.25:
            turn = rng.choice(TOPIC_FOLLOWUPS).format(topic=topic)
        else:
            turn = rng.choice(pool)
        if turn not in turns:
            turns.append(turn)
    return turns


def photo_question(rng: random.Random) -> tuple[str, str]:
    """(kind, question) about a photograph, the kinds equally likely."""
    kind = rng.choice(PHOTO_KINDS)
    return kind, rng.choice(PHOTO_QUESTIONS_BY_KIND[kind])


__all__ = ["FOLLOWUPS", "HELDOUT_KEYS", "PHOTO_FOLLOWUPS", "PHOTO_KINDS", "PHOTO_QUESTIONS_BY_KIND", "TEXT_TEMPLATES", "TOPICS",
           "TOPIC_FOLLOWUPS", "followup_turns", "is_heldout", "photo_question", "prompt_key", "text_prompt"]
