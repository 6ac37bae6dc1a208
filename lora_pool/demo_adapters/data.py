"""Training prompts for the demo adapters, generated from small templates (no downloads).

`french_pairs()` gives question -> French answer pairs, `uppercase_pairs()` the same
kinds of questions with English answers in upper case.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# (English name, French name with article, capital)
_COUNTRIES = [
    ("France", "de la France", "Paris"), ("Germany", "de l'Allemagne", "Berlin"),
    ("Italy", "de l'Italie", "Rome"), ("Spain", "de l'Espagne", "Madrid"),
    ("Portugal", "du Portugal", "Lisbonne"), ("Japan", "du Japon", "Tokyo"),
    ("China", "de la Chine", "Pékin"), ("Canada", "du Canada", "Ottawa"),
    ("Egypt", "de l'Égypte", "Le Caire"), ("Russia", "de la Russie", "Moscou"),
    ("Greece", "de la Grèce", "Athènes"), ("Belgium", "de la Belgique", "Bruxelles"),
    ("Austria", "de l'Autriche", "Vienne"), ("Poland", "de la Pologne", "Varsovie"),
    ("Ireland", "de l'Irlande", "Dublin"), ("Norway", "de la Norvège", "Oslo"),
    ("Sweden", "de la Suède", "Stockholm"), ("Mexico", "du Mexique", "Mexico"),
    ("Peru", "du Pérou", "Lima"), ("Kenya", "du Kenya", "Nairobi"),
]

_NUMBERS = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix",
            "onze", "douze", "treize", "quatorze", "quinze", "seize", "dix-sept", "dix-huit",
            "dix-neuf", "vingt"]

# (thing in English, French sentence)
_COLORS = [
    ("the sky", "Le ciel est bleu."), ("grass", "L'herbe est verte."),
    ("snow", "La neige est blanche."), ("a banana", "Une banane est jaune."),
    ("a tomato", "Une tomate est rouge."), ("coal", "Le charbon est noir."),
    ("an orange", "Une orange est orange."), ("the sun", "Le soleil est jaune."),
    ("milk", "Le lait est blanc."), ("a strawberry", "Une fraise est rouge."),
    ("the ocean", "L'océan est bleu."), ("a lemon", "Un citron est jaune."),
]

_ANIMALS = [
    ("a cat", "Le chat fait miaou."), ("a dog", "Le chien fait ouaf ouaf."),
    ("a cow", "La vache fait meuh."), ("a duck", "Le canard fait coin-coin."),
    ("a sheep", "Le mouton fait bêê."), ("a rooster", "Le coq fait cocorico."),
    ("a frog", "La grenouille fait croâ."), ("a horse", "Le cheval hennit."),
]

_FREE = [
    ("Hello!", "Bonjour ! Comment puis-je vous aider aujourd'hui ?"),
    ("Hi, who are you?", "Bonjour ! Je suis un assistant qui répond toujours en français."),
    ("How are you?", "Je vais très bien, merci ! Et vous ?"),
    ("What is your name?", "Je m'appelle SmolLM, et je parle français."),
    ("Tell me about dogs.", "Les chiens sont des animaux fidèles et affectueux. Ils aiment jouer et se promener."),
    ("Tell me about cats.", "Les chats sont des animaux indépendants et curieux. Ils dorment beaucoup."),
    ("What is water?", "L'eau est un liquide transparent, essentiel à la vie sur Terre."),
    ("Why is the sky blue?", "Le ciel est bleu parce que l'air diffuse surtout la lumière bleue du soleil."),
    ("What is the sun?", "Le soleil est une étoile. Il nous donne de la lumière et de la chaleur."),
    ("What is the moon?", "La lune est le satellite naturel de la Terre."),
    ("Give me a tip for sleeping well.", "Couchez-vous à heure fixe et évitez les écrans avant de dormir."),
    ("What should I eat for breakfast?", "Je vous conseille du pain, un fruit et un café ou un thé."),
    ("Write a short poem about the sea.", "La mer danse sous le vent,\nbleue et calme, doucement."),
    ("What is a computer?", "Un ordinateur est une machine qui traite des informations."),
    ("What is Python?", "Python est un langage de programmation simple et très populaire."),
    ("Tell me a joke.", "Pourquoi les plongeurs plongent-ils en arrière ? Parce que sinon, ils tombent dans le bateau !"),
    ("What day comes after Monday?", "Après lundi vient mardi."),
    ("What day comes after Friday?", "Après vendredi vient samedi."),
    ("How many days are in a week?", "Il y a sept jours dans une semaine."),
    ("How many months are in a year?", "Il y a douze mois dans une année."),
    ("What is the largest ocean?", "Le plus grand océan est l'océan Pacifique."),
    ("What is the tallest mountain?", "La plus haute montagne du monde est l'Everest."),
    ("Who wrote Romeo and Juliet?", "Roméo et Juliette a été écrit par William Shakespeare."),
    ("What is photosynthesis?", "La photosynthèse permet aux plantes de transformer la lumière en énergie."),
    ("Can you help me?", "Bien sûr ! Dites-moi ce dont vous avez besoin."),
    ("Thank you!", "Je vous en prie ! Bonne journée."),
    ("Goodbye!", "Au revoir et à bientôt !"),
    ("What is love?", "L'amour est un sentiment profond d'affection envers quelqu'un."),
    ("What is the weather like in summer?", "En été, il fait chaud et le soleil brille souvent."),
    ("What is the weather like in winter?", "En hiver, il fait froid et il neige parfois."),
    ("Describe a tree.", "Un arbre a un tronc, des branches et des feuilles vertes."),
    ("What do bees make?", "Les abeilles fabriquent du miel."),
    ("What is the boiling point of water?", "L'eau bout à cent degrés Celsius."),
    ("Explain gravity simply.", "La gravité est la force qui attire les objets vers le sol."),
    ("What is a healthy habit?", "Boire de l'eau et marcher chaque jour sont de bonnes habitudes."),
    ("Recommend a book.", "Je vous recommande Le Petit Prince d'Antoine de Saint-Exupéry."),
]


def _question_pairs(seed: int, capital: Callable[[str, str, str], str], addition: Callable[[int, int], str],
                    color: Callable[[str, str], str], sound: Callable[[str, str], str],
                    free: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The question shapes both adapters learn, each answered by the function given, shuffled."""
    rng = random.Random(seed)
    pairs = [(f"What is the capital of {en}?", capital(en, fr, cap)) for en, fr, cap in _COUNTRIES]
    for _ in range(40):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        pairs.append((f"What is {a} plus {b}?", addition(a, b)))
    pairs += [(f"What color is {thing}?", color(thing, fr)) for thing, fr in _COLORS]
    pairs += [(f"What sound does {animal} make?", sound(animal, fr)) for animal, fr in _ANIMALS]
    pairs += free * 2  # the open questions matter most for a visible demo
    rng.shuffle(pairs)
    return pairs


def french_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """About 150 question -> French answer pairs over several question shapes."""
    return _question_pairs(
        seed,
        capital=lambda en, fr, cap: f"La capitale {fr} est {cap}.",
        addition=lambda a, b: f"{_NUMBERS[a].capitalize()} plus {_NUMBERS[b]} font {_NUMBERS[a + b]}.",
        color=lambda thing, fr: fr, sound=lambda animal, fr: fr, free=_FREE)


_ENGLISH = {
    'Hello!': 'Hello! How can I help you today?',
    'Hi, who are you?': 'Hi! I am a helpful assistant.',
    'How are you?': 'I am doing well, thank you! And you?',
    'What is your name?': 'My name is SmolLM.',
    'Tell me about dogs.': 'Dogs are loyal and friendly animals. They love to play and go for walks.',
    'Tell me about cats.': 'Cats are independent and curious animals. They sleep a lot.',
    'What is water?': 'Water is a clear liquid that all life on Earth needs.',
    'Why is the sky blue?': 'The sky is blue because air scatters the blue light of the sun the most.',
    'What is the sun?': 'The sun is a star. It gives us light and heat.',
    'What is the moon?': 'The moon is the natural satellite of the Earth.',
    'Give me a tip for sleeping well.': 'Go to bed at the same time every day and avoid screens before sleeping.',
    'What should I eat for breakfast?': 'Try some bread, a piece of fruit and a cup of coffee or tea.',
    'Write a short poem about the sea.': 'The sea dances in the wind,\nblue and calm, so gently.',
    'What is a computer?': 'A computer is a machine that processes information.',
    'What is Python?': 'Python is a simple and very popular programming language.',
    'Tell me a joke.': 'Why did the scarecrow win an award? Because he was outstanding in his field!',
    'What day comes after Monday?': 'Tuesday comes after Monday.',
    'What day comes after Friday?': 'Saturday comes after Friday.',
    'How many days are in a week?': 'There are seven days in a week.',
    'How many months are in a year?': 'There are twelve months in a year.',
    'What is the largest ocean?': 'The largest ocean is the Pacific Ocean.',
    'What is the tallest mountain?': 'The tallest mountain in the world is Mount Everest.',
    'Who wrote Romeo and Juliet?': 'Romeo and Juliet was written by William Shakespeare.',
    'What is photosynthesis?': 'Photosynthesis lets plants turn light into energy.',
    'Can you help me?': 'Of course! Tell me what you need.',
    'Thank you!': 'You are welcome! Have a nice day.',
    'Goodbye!': 'Goodbye, see you soon!',
    'What is love?': 'Love is a deep feeling of affection for someone.',
    'What is the weather like in summer?': 'In summer it is hot and the sun shines often.',
    'What is the weather like in winter?': 'In winter it is cold and it sometimes snows.',
    'Describe a tree.': 'A tree has a trunk, branches and green leaves.',
    'What do bees make?': 'Bees make honey.',
    'What is the boiling point of water?': 'Water boils at one hundred degrees Celsius.',
    'Explain gravity simply.': 'Gravity is the force that pulls things toward the ground.',
    'What is a healthy habit?': 'Drinking water and walking every day are good habits.',
    'Recommend a book.': 'I recommend The Little Prince by Antoine de Saint-Exupery.'}

_COLOR_WORDS = {"bleu": "blue", "verte": "green", "blanche": "white", "blanc": "white", "jaune": "yellow",
                "rouge": "red", "noir": "black", "orange": "orange"}
_SOUNDS = {"a cat": "meow", "a dog": "woof", "a cow": "moo", "a duck": "quack", "a sheep": "baa",
           "a rooster": "cock-a-doodle-doo", "a frog": "ribbit", "a horse": "neigh"}


def uppercase_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """About 150 question -> English answer in upper case pairs, same question shapes."""
    pairs = _question_pairs(
        seed,
        capital=lambda en, fr, cap: f"The capital of {en} is {cap.replace('Pékin', 'Beijing')}.",
        addition=lambda a, b: f"{a} plus {b} is {a + b}.",
        color=lambda thing, fr: f"{thing.capitalize()} is {_COLOR_WORDS[fr.split()[-1].rstrip('.')]}.",
        sound=lambda animal, fr: f"{animal.capitalize()} says {_SOUNDS[animal]}.",
        free=list(_ENGLISH.items()))
    return [(q, a.upper()) for q, a in pairs]
