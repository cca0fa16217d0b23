"""What the tests and the benchmarks both start, kept out of ``tests/`` so that a benchmark never
imports a test module: ``foretell serve`` as a process (``live_server``), a small real
OpenAI-compatible upstream (``upstream_stub``) and the probe table of bad requests (``probes``).
Not part of the installed package: it is imported from the repository root."""
