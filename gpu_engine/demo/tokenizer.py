"""The demos' byte-level BPE tokenizers, trained offline on local text.

Owns the trainer settings (<unk>, <s>, </s> at ids 0, 1, 2), the random demo's
embedded prose (vocab 512) and the files transformers' AutoTokenizer needs.
Never downloads anything; the same text always yields the same tokenizer.json.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
MODEL_MAX_LENGTH = 4096

TRAINING_TEXT = """\
The harbour town woke slowly on winter mornings. Fishermen walked down to the
boats before the sun came up, carrying coffee in dented cans and talking about
the weather in low voices. The gulls were already awake, circling above the
market hall and waiting for the first crates of herring to be opened on the
stone floor. By eight o'clock the bakery had sold most of its bread, and the
smell of warm rye drifted along the street toward the church and the school.

Anna ran the small bookshop next to the post office. She had inherited it from
her grandfather, who had kept every receipt since the year he opened the door
for the first time. The shelves were crowded with maps, sea charts, old novels
and thin books of poetry that nobody seemed to buy but everybody liked to read
while standing in the aisle. On quiet afternoons she sat by the window with a
pot of tea and wrote letters to friends who had moved to the city.

Learning a new skill takes patience. At first every step feels clumsy, and the
mind is busy with details that later become invisible. A beginner at the piano
counts the beats aloud, watches the hands and forgets to listen to the music.
After weeks of practice the fingers find the keys on their own, and attention
is free to follow the melody. The same is true of cooking, of writing, of
riding a bicycle and of speaking a foreign language. What matters most is to
practise a little every day, to notice mistakes without anger, and to keep a
sense of curiosity about what could be done better next time.

The river that runs through the valley is wide and slow in summer. Children
swim near the old mill, where the water is shallow and the stones are smooth.
In the evening farmers bring their cattle down to drink, and the light turns
gold over the fields of wheat and barley. In spring, however, the river can be
dangerous. Melting snow from the mountains fills it to the top of its banks,
and more than once it has flooded the lower streets of the village, carrying
away fences, garden chairs and the occasional surprised goat.

A good recipe for vegetable soup begins with an onion, two carrots, a stick of
celery and a few potatoes. Cut everything into small pieces and cook it gently
in a little oil until the onion is soft. Add water or stock, a bay leaf and a
pinch of salt, then let the pot simmer for about forty minutes. Near the end,
stir in a handful of green beans or peas, and taste the soup before serving.
Some people like to add fresh parsley, a spoon of cream or a slice of bread.

Computers follow instructions exactly, which is both their strength and their
weakness. A program does what it was told to do, not what its author meant to
say. When something goes wrong, the patient work of finding the mistake begins:
reading the code line by line, printing values, forming a guess and testing it.
Good engineers write small functions with clear names, keep notes about why a
decision was made, and test their work with examples that could reveal a fault.
They know that a clear design is easier to change than a clever one.

The night train left the station at ten minutes past eleven. Most passengers
fell asleep before the first stop, wrapped in coats and scarves, their bags
pushed under the seats. A young man by the window kept reading by the light of
a small lamp, turning the pages carefully so as not to wake the woman beside
him. Outside, the dark forest passed in silence, broken now and then by the
lights of a farm or a level crossing where a bell rang and then faded away.

Questions are often more useful than answers. Why does ice float on water? How
far away is the moon, and how do we know? What would happen if every bee in the
world disappeared tomorrow? Asking such questions, and then looking patiently
for evidence, is how science moves forward. It is also how children learn about
the world: they touch, they taste, they break things, and they ask why, again
and again, until the grown-ups around them run out of words.

In the autumn the orchard was full of apples, red and yellow and green. The
whole family helped with the harvest, climbing ladders, filling baskets and
carrying them to the barn. Some of the fruit was sold at the market on Saturday,
some was pressed into juice, and the rest was stored in the cool cellar, where
it would last until the end of February. Grandmother made pies every Sunday,
and the kitchen smelled of cinnamon, butter and baked apples all winter long.
"""


def train_tokenizer(lines: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with <unk>, <s>, </s> at ids 0, 1, 2, trained on `lines` (deterministic)."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        # Too little text for the merges would silently shrink the vocab below the model's.
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    return tokenizer


def build_demo_tokenizer() -> Tokenizer:
    """Train the random demo's BPE tokenizer on TRAINING_TEXT (deterministic)."""
    return train_tokenizer(TRAINING_TEXT.splitlines(keepends=True), VOCAB_SIZE)


def write_tokenizer(dest: Path, tokenizer: Tokenizer | None = None) -> None:
    """Write tokenizer.json (default: the random demo's), tokenizer_config.json and special_tokens_map.json."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer() if tokenizer is None else tokenizer
    (dest / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
