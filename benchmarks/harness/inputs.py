"""Real inputs for benchmark requests: sentences of about 20 words."""

from __future__ import annotations

import random

_VOCABULARY = (
    "the a our their every new old small large quiet busy local early late customer team "
    "report order system server network river city market village school doctor teacher "
    "engineer farmer driver student family friend manager office window garden kitchen "
    "morning evening weekend summer winter train bus bridge road station library museum "
    "checks sends reads writes builds opens closes moves finds brings keeps shows asks "
    "answers follows changes carries prepares visits repairs cleans counts measures "
    "quickly slowly carefully often rarely always never again together alone "
    "before after during while because although since until near under over behind "
    "with without for from into about across along between through"
)


def sentences(count: int = 512, seed: int = 7) -> list[str]:
    """``count`` distinct sentences of 18-22 words (deterministic)."""
    rng = random.Random(seed)
    vocabulary = _VOCABULARY.split()
    out = []
    for _ in range(count):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(18, 22))]
        out.append(" ".join(words).capitalize() + ".")
    return out
