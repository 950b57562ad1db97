"""The bilingual English→French lexicon behind the built-in corpus.

Every entry is a lemma pair that pyrealb's own English and French lexicons
know; tests/training/test_lexicon.py checks each one against them, so an entry
that pyrealb cannot inflect never reaches the corpus.

Tables are plain text so that a newcomer can extend them without code:
one entry per line, fields separated by whitespace, `_` joins multi-word
lemmas.
"""

from __future__ import annotations

from dataclasses import dataclass

# english french gender(m/f) kind(a=animate, t=thing)
_NOUNS = """
cat chat m a
dog chien m a
horse cheval m a
bird oiseau m a
mouse souris f a
cow vache f a
pig cochon m a
sheep mouton m a
rabbit lapin m a
fox renard m a
wolf loup m a
bear ours m a
lion lion m a
tiger tigre m a
elephant éléphant m a
monkey singe m a
snake serpent m a
fish poisson m a
duck canard m a
chicken poulet m a
goat chèvre f a
frog grenouille f a
bee abeille f a
spider araignée f a
turtle tortue f a
whale baleine f a
owl hibou m a
donkey âne m a
camel chameau m a
man homme m a
woman femme f a
boy garçon m a
girl fille f a
child enfant m a
baby bébé m a
friend ami m a
teacher professeur m a
student étudiant m a
doctor médecin m a
nurse infirmier m a
farmer fermier m a
baker boulanger m a
cook cuisinier m a
king roi m a
queen reine f a
prince prince m a
princess princesse f a
soldier soldat m a
lawyer avocat m a
writer écrivain m a
painter peintre m a
singer chanteur m a
dancer danseur m a
driver conducteur m a
pilot pilote m a
neighbour voisin m a
brother frère m a
sister soeur f a
father père m a
mother mère f a
uncle oncle m a
aunt tante f a
cousin cousin m a
grandfather grand-père m a
grandmother grand-mère f a
son fils m a
daughter fille f a
husband mari m a
nephew neveu m a
niece nièce f a
guest invité m a
thief voleur m a
judge juge m a
engineer ingénieur m a
waiter serveur m a
merchant marchand m a
priest prêtre m a
sailor marin m a
hunter chasseur m a
player joueur m a
apple pomme f t
book livre m t
house maison f t
car voiture f t
tree arbre m t
flower fleur f t
table table f t
chair chaise f t
door porte f t
window fenêtre f t
letter lettre f t
cake gâteau m t
bread pain m t
cheese fromage m t
wine vin m t
milk lait m t
water eau f t
soup soupe f t
egg oeuf m t
orange orange f t
pear poire f t
banana banane f t
lemon citron m t
carrot carotte f t
onion oignon m t
tomato tomate f t
key clé f t
box boîte f t
bag sac m t
hat chapeau m t
shoe chaussure f t
shirt chemise f t
dress robe f t
coat manteau m t
ball balle f t
toy jouet m t
picture tableau m t
photo photo f t
map carte f t
newspaper journal m t
song chanson f t
story histoire f t
film film m t
game jeu m t
question question f t
answer réponse f t
idea idée f t
gift cadeau m t
ring bague f t
watch montre f t
clock horloge f t
phone téléphone m t
computer ordinateur m t
lamp lampe f t
bed lit m t
bottle bouteille f t
glass verre m t
cup tasse f t
plate assiette f t
knife couteau m t
spoon cuillère f t
fork fourchette f t
pen stylo m t
pencil crayon m t
boat bateau m t
train train m t
bicycle vélo m t
plane avion m t
bus autobus m t
road route f t
street rue f t
bridge pont m t
river rivière f t
lake lac m t
sea mer f t
mountain montagne f t
forest forêt f t
field champ m t
garden jardin m t
park parc m t
city ville f t
village village m t
school école f t
church église f t
shop magasin m t
market marché m t
station gare f t
hospital hôpital m t
office bureau m t
kitchen cuisine f t
room chambre f t
wall mur m t
roof toit m t
stone pierre f t
sun soleil m t
moon lune f t
star étoile f t
"""

# english french position-in-french(pre/post)
_ADJECTIVES = """
red rouge post
blue bleu post
green vert post
black noir post
white blanc post
yellow jaune post
grey gris post
brown brun post
big grand pre
small petit pre
old vieux pre
young jeune pre
new nouveau pre
good bon pre
bad mauvais pre
beautiful beau pre
pretty joli pre
fat gros pre
short court post
happy heureux post
sad triste post
tired fatigué post
hungry affamé post
angry fâché post
rich riche post
poor pauvre post
strong fort post
weak faible post
fast rapide post
slow lent post
hot chaud post
cold froid post
heavy lourd post
light léger post
clean propre post
dirty sale post
empty vide post
full plein post
easy facile post
difficult difficile post
strange étrange post
famous célèbre post
funny drôle post
quiet calme post
kind gentil post
polite poli post
proud fier post
brave courageux post
lazy paresseux post
clever intelligent post
curious curieux post
honest honnête post
wild sauvage post
sweet doux post
bitter amer post
fresh frais post
dry sec post
wet mouillé post
round rond post
square carré post
wide large post
narrow étroit post
deep profond post
soft mou post
expensive cher post
sick malade post
modern moderne post
ancient ancien post
dangerous dangereux post
useful utile post
"""

# english french: verbs taking a direct object
_TRANSITIVE_VERBS = """
eat manger
see voir
like aimer
love adorer
want vouloir
find trouver
take prendre
buy acheter
sell vendre
open ouvrir
close fermer
read lire
write écrire
draw dessiner
paint peindre
build construire
break casser
repair réparer
clean nettoyer
wash laver
cook cuisiner
carry porter
push pousser
pull tirer
throw lancer
catch attraper
hold tenir
watch regarder
hear entendre
know connaître
forget oublier
remember retenir
follow suivre
help aider
visit visiter
call appeler
meet rencontrer
await attendre
seek chercher
lose perdre
hide cacher
show montrer
bring apporter
drink boire
prefer préférer
choose choisir
hate détester
need nécessiter
kill tuer
cut couper
fill remplir
move déplacer
touch toucher
count compter
receive recevoir
send envoyer
teach enseigner
learn apprendre
understand comprendre
describe décrire
leave quitter
finish finir
begin commencer
accept accepter
refuse refuser
protect protéger
attack attaquer
chase chasser
feed nourrir
kiss embrasser
"""

# english french: verbs without an object
_INTRANSITIVE_VERBS = """
sleep dormir
run courir
walk marcher
swim nager
dance danser
sing chanter
laugh rire
cry pleurer
smile sourire
jump sauter
fall tomber
arrive arriver
leave partir
come venir
go aller
work travailler
play jouer
travel voyager
speak parler
shout crier
rest reposer
wait attendre
listen écouter
fly voler
eat manger
read lire
write écrire
think réfléchir
hesitate hésiter
win gagner
cook cuisiner
"""

# english french
_ADVERBS = """
quickly rapidement
slowly lentement
quietly tranquillement
carefully soigneusement
happily joyeusement
sadly tristement
easily facilement
loudly bruyamment
gently doucement
rarely rarement
often souvent
together ensemble
again encore
suddenly soudain
badly mal
well bien
calmly calmement
politely poliment
proudly fièrement
bravely courageusement
patiently patiemment
silently silencieusement
regularly régulièrement
"""

# english french
_PREPOSITIONS = """
in dans
on sur
under sous
behind derrière
with avec
without sans
for pour
after après
before avant
during pendant
between entre
against contre
to à
from de
toward vers
"""

# the prepositions that make sense before a place
PLACE_PREPOSITIONS = ("in", "on", "under", "behind")
# those that make sense before a person or thing accompanying the action
COMPANY_PREPOSITIONS = ("with", "without", "for", "against")

# english surface, french surface, person, number, gender: pyrealb inflects
# the lemmas "I" and "je" from these features
_PRONOUNS = """
I je 1 s m
you vous 2 p m
he il 3 s m
she elle 3 s f
we nous 1 p m
they ils 3 p m
"""

# english french number(s=singular only, p=plural only, b=both)
_DETERMINERS = """
the le b
a un b
this ce b
that ce b
every chaque s
"""

# english surface, french lemma, owner person, number and gender: pyrealb
# inflects English "my" and French "mon"/"notre"/"votre"/"leur" from them
_POSSESSIVES = """
my mon 1 s m
his son 3 s m
her son 3 s f
our notre 1 p m
your votre 2 p m
their leur 3 p m
"""

_NUMBERS = """
two deux 2
three trois 3
four quatre 4
five cinq 5
six six 6
seven sept 7
eight huit 8
nine neuf 9
ten dix 10
twelve douze 12
twenty vingt 20
"""

_COORDINATIONS = """
and et
or ou
"""

# english french: the relative pronoun for a subject relative clause
_RELATIVES = """
who qui
that qui
"""


@dataclass(frozen=True)
class Noun:
    en: str
    fr: str
    gender: str  # French grammatical gender, "m" or "f"
    animate: bool


@dataclass(frozen=True)
class Adjective:
    en: str
    fr: str
    position: str  # French position relative to the noun: "pre" or "post"


@dataclass(frozen=True)
class Pair:
    en: str
    fr: str


@dataclass(frozen=True)
class Pronoun:
    en: str
    fr: str
    person: int
    number: str
    gender: str


@dataclass(frozen=True)
class Determiner:
    en: str
    fr: str
    number: str  # "s", "p" or "b" (both)


@dataclass(frozen=True)
class Possessive:
    en: str
    fr: str
    person: int
    owner_number: str
    owner_gender: str


@dataclass(frozen=True)
class Number:
    en: str
    fr: str
    value: int


def _rows(table: str) -> list[list[str]]:
    return [[f.replace("_", " ") for f in line.split()] for line in table.strip().splitlines()]


NOUNS = tuple(Noun(en, fr, g, kind == "a") for en, fr, g, kind in _rows(_NOUNS))
ADJECTIVES = tuple(Adjective(*row) for row in _rows(_ADJECTIVES))
TRANSITIVE_VERBS = tuple(Pair(*row) for row in _rows(_TRANSITIVE_VERBS))
INTRANSITIVE_VERBS = tuple(Pair(*row) for row in _rows(_INTRANSITIVE_VERBS))
ADVERBS = tuple(Pair(*row) for row in _rows(_ADVERBS))
PREPOSITIONS = tuple(Pair(*row) for row in _rows(_PREPOSITIONS))
PRONOUNS = tuple(Pronoun(en, fr, int(pe), n, g) for en, fr, pe, n, g in _rows(_PRONOUNS))
DETERMINERS = tuple(Determiner(*row) for row in _rows(_DETERMINERS))
POSSESSIVES = tuple(Possessive(en, fr, int(pe), n, g) for en, fr, pe, n, g in _rows(_POSSESSIVES))
NUMBERS = tuple(Number(en, fr, int(v)) for en, fr, v in _rows(_NUMBERS))
COORDINATIONS = tuple(Pair(*row) for row in _rows(_COORDINATIONS))
RELATIVES = tuple(Pair(*row) for row in _rows(_RELATIVES))

ANIMATE_NOUNS = tuple(n for n in NOUNS if n.animate)
PREPOSITION = {p.en: p for p in PREPOSITIONS}


def lemma_pair_count() -> int:
    """How many lemma pairs the lexicon holds, all categories together."""
    tables = (NOUNS, ADJECTIVES, TRANSITIVE_VERBS, INTRANSITIVE_VERBS, ADVERBS, PREPOSITIONS,
              PRONOUNS, DETERMINERS, POSSESSIVES, NUMBERS, COORDINATIONS, RELATIVES)
    return sum(len(t) for t in tables)
