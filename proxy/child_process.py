"""Work on megabytes of text done in a child process, so that it never holds the GIL of the
server's process, which the engine's thread takes back after every tensor operation: in a thread
of the server's own process, a second of pure-Python (or GIL-holding native) work delays every
decoding step of every running stream for as long (measured: a 1 MiB prediction's tokenisation
stretched a running stream's gap between chunks from ~80 ms to ~450 ms).

A child is a module run as a program (not multiprocessing, whose children import the parent's
main script again), at a lower priority than the engine's threads, importing nothing heavy; it
answers pickled questions on its stdin with pickled answers on its stdout, one at a time.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Callable


class Child:
    """A child process running ``python -m module`` (a module whose main calls ``serve``)."""

    def __init__(self, module: str):
        self.module = module
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the child, if it is not running (also after it died)."""
        with self.lock:
            self._start()

    def ask(self, *question):
        """The child's answer to ``question`` (blocks the calling thread, not the GIL). OSError,
        EOFError or pickle.PickleError where the child cannot answer."""
        with self.lock:  # one question at a time on the pipe
            self._start()
            pickle.dump(question, self.process.stdin)
            self.process.stdin.flush()
            return pickle.load(self.process.stdout)

    def _start(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, "-m", self.module], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)


def serve(answer: Callable) -> None:
    """The child's loop: each question (a tuple) in, ``answer(*question)`` out, until the parent
    has gone."""
    os.nice(10)
    while True:
        try:
            question = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        pickle.dump(answer(*question), sys.stdout.buffer)
        sys.stdout.buffer.flush()
