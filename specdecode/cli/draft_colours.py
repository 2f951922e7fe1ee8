"""`generate --show-drafts`: the answer in the terminal with each token coloured by where it came from
(engine/provenance.py), the way the live view in `specdecode serve` shows it."""

from __future__ import annotations

import codecs

from specdecode.engine.request import GenerationEvent
from specdecode.models.tokenizer import Tokenizer

RESET = "\033[0m"
COLOURS = {"draft": "\033[32m", "bonus": "\033[36m", "corrected": "\033[33m", "target": ""}  # ANSI: green, cyan,
# yellow, the terminal's own
LEGEND = (f"[{COLOURS['draft']}accepted draft{RESET}, {COLOURS['bonus']}bonus token (every draft accepted){RESET}, "
          f"{COLOURS['corrected']}the target's correction of a rejected draft{RESET}, plain: a step without drafts]")


class DraftColours:
    """Turns events into coloured text: each token's own bytes, decoded as they complete characters (a character
    split across tokens takes the colour of the token that completes it)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def text(self, event: GenerationEvent) -> str:
        pieces = []
        for token, origin in zip(event.token_ids, event.origins or ()):
            if self.tokenizer.is_special(token):
                continue
            piece = self.decoder.decode(self.tokenizer.token_bytes(token))
            colour = COLOURS[origin.kind]
            pieces.append(f"{colour}{piece}{RESET}" if colour and piece else piece)
        if event.finish_reason is not None:
            pieces.append(self.decoder.decode(b"", final=True))
        return "".join(pieces)
