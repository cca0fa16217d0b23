"""A batch of edits at once with the AsyncClient.

    python examples/async_batch_edits.py [--base-url URL] [--model M]

The requests go out together; the foretell proxy queues them and runs one generation at a time,
each with its file as the prediction. A hosted API runs them in parallel.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from foretell.sdk import AsyncClient, aedit

FILES = {
    "greet.py": 'def greet(name):\n    return "Hello, " + name\n',
    "total.py": "def total(prices):\n    return sum(prices)\n",
    "square.py": "def square(x):\n    return x * x\n",
}
INSTRUCTION = "Add type hints."


async def run(base_url: str | None, model: str) -> None:
    async with AsyncClient(base_url) as client:
        results = await asyncio.gather(*(aedit(client, text, INSTRUCTION, model=model, filename=name)
                                          for name, text in FILES.items()), return_exceptions=True)
    for name, result in zip(FILES, results):
        if isinstance(result, Exception):
            print(f"{name}: failed: {result}")
            continue
        print(f"{name}: {'changed' if result.changed else 'unchanged'}, "
              f"{result.completion_tokens} tokens, {result.accepted_prediction_tokens} prediction "
              f"tokens accepted, {result.seconds:.1f} s")
    failures = sum(isinstance(r, Exception) for r in results)
    print(f"{len(FILES) - failures} of {len(FILES)} edits done")
    if failures:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url")
    parser.add_argument("--model", default=os.environ.get("FORETELL_MODEL", "gemma-3-270m"))
    args = parser.parse_args()
    asyncio.run(run(args.base_url, args.model))


if __name__ == "__main__":
    main()
