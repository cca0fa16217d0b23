"""RAG-style summarising with prompt lookup: the answer quotes the retrieved passages, so drafts
copied from the prompt are often right.

    python examples/rag_summary.py [--base-url URL] [--model M]

No prediction here: `prompt_lookup=True` asks foretell to draft by copying n-grams of the prompt
and of the answer so far. Against a server that is not foretell the option is dropped with a
warning, and the same call still works.
"""

from __future__ import annotations

import argparse
import os

from foretell.sdk import Client

PASSAGES = [
    "The Rhine is a river that rises in the Swiss Alps and flows into the North Sea. "
    "It is about 1,230 kilometres long.",
    "The Rhine forms part of the border between Switzerland and Germany, and between "
    "France and Germany.",
    "Cologne, Düsseldorf and Basel lie on the Rhine.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url")
    parser.add_argument("--model", default=os.environ.get("FORETELL_MODEL", "gemma-3-270m"))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    context = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(PASSAGES))
    prompt = (f"Passages:\n{context}\n\nQuestion: How long is the Rhine and where does it flow?\n"
              "Answer, quoting the passages:")
    with Client(args.base_url) as client:
        response = client.completions.create(model=args.model, prompt=prompt, max_tokens=args.max_tokens,
                                             temperature=0, stop=["\n\n"], prompt_lookup=True)
    print("answer:", response.text.strip())
    print(f"tokens: {response.usage.completion_tokens} ({response.choices[0].finish_reason})")
    if response.speculation is not None:
        lookup = response.speculation.per_source.get("prompt_lookup")
        if lookup is not None:
            print(f"prompt lookup: drafted {lookup.drafted}, accepted {lookup.accepted}; "
                  f"{response.speculation.target_passes} target passes")


if __name__ == "__main__":
    main()
