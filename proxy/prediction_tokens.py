"""A long prediction tokenised in a child process (``child_process.py``), not in the server's.

Tokenising a megabyte of prediction (250k tokens, ~0.75 s) holds the server's GIL for most of
that time, in the tokenizer and in turning its output into Python lists, and the engine's thread
waits for the GIL after every tensor operation: every running stream stalls. The child holds the
same Rust tokenizer (its ``tokenizer.json``) and sends back the ids and offsets as packed
integers, which become lists here in a few milliseconds. A probe checks once that the child
tokenises as the server's tokenizer does; where it does not, or the child cannot run, the
prediction is tokenised here as before.

The child holds a large vocabulary's tokenizer (~300 MB for Gemma's 262k tokens), so it starts
with the first long prediction (which waits about a second for it), not with every server, and
one child per tokenizer file serves the whole process.
"""

from __future__ import annotations

import os
import pickle
import threading
from array import array

from foretell.proxy.child_process import Child, serve

# Predictions at least this long are tokenised in the child (shorter ones take milliseconds).
CHILD_PROCESS_CHARS = 32 * 1024
_CHILDREN: dict = {}  # tokenizer file -> its Child, shared by every server of the process
_CHILDREN_LOCK = threading.Lock()
PROBE = "def probe(x):\n    return {'é': x}  # 東京 🙂\n\tdone\n"


class PredictionTokenizer:
    """``encode(prediction)``: its ``PredictionEncoding``, long ones from the child."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        folder = getattr(tokenizer, "name_or_path", "") or ""
        self.source = os.path.join(folder, "tokenizer.json")
        # None: not tried yet; False: the child is not used (no tokenizer file, or it differs).
        self.usable: bool | None = None if os.path.isfile(self.source) else False
        with _CHILDREN_LOCK:
            self.child = _CHILDREN.setdefault(self.source, Child(__name__))
        self.lock = threading.Lock()

    def encode(self, prediction: str):
        from foretell.proxy.engine.draft_sources import PredictionEncoding

        if len(prediction) >= CHILD_PROCESS_CHARS and self._child_ready():
            try:
                return self._from_child(prediction)
            except (OSError, EOFError, pickle.PickleError):
                pass
        return PredictionEncoding.of(self.tokenizer, prediction)

    def _child_ready(self) -> bool:
        from foretell.proxy.engine.draft_sources import PredictionEncoding

        with self.lock:
            if self.usable is None:
                try:
                    self.usable = self._from_child(PROBE) == PredictionEncoding.of(self.tokenizer, PROBE)
                except (OSError, EOFError, pickle.PickleError):
                    self.usable = False
            return self.usable

    def _from_child(self, text: str):
        from foretell.proxy.engine.draft_sources import PredictionEncoding

        answer = self.child.ask(self.source, text)
        if answer is None:
            raise EOFError("the child could not load the tokenizer")
        ids, starts = (array("q", packed).tolist() for packed in answer)
        return PredictionEncoding(ids, starts)


# ---- the child ------------------------------------------------------------------------------

_loaded: dict = {}


def _encode(source: str, text: str):
    """(ids, token starts) of ``text`` as packed integers; None where the tokenizer cannot load."""
    if source not in _loaded:
        try:
            from tokenizers import Tokenizer

            _loaded[source] = Tokenizer.from_file(source)
        except Exception:
            return None
    [encoding] = _loaded[source].encode_batch([text], add_special_tokens=False)
    return array("q", encoding.ids).tobytes(), array("q", [start for start, _ in encoding.offsets]).tobytes()


if __name__ == "__main__":
    serve(_encode)
