"""The same edit with the official `openai` package pointed at the foretell proxy.

    python examples/openai_edit.py [--base-url URL] [--model M]

`prediction=` is OpenAI's own parameter; foretell's extension goes in `extra_body`. The proxy's
speculation report is an extra field of the response (`response.model_extra["speculation"]`).
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

BEFORE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("FORETELL_BASE_URL")
                        or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=os.environ.get("FORETELL_MODEL", "gemma-3-270m"))
    args = parser.parse_args()

    # The proxy needs no key unless started with --api-key; the package insists on one.
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("FORETELL_API_KEY", "not-needed"))
    instruction = "Rename width to w."
    response = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": (
            f"Edit shapes.py. {instruction}\n\nshapes.py before the edit:\n```python\n{BEFORE}```\n\n"
            "Reply with shapes.py after the edit, the whole file in one ```python block.")}],
        prediction={"type": "content", "content": "```python\n" + BEFORE},  # the answer if nothing changed
        extra_body={"speculation": {"prompt_lookup": True}},  # foretell's extension
        temperature=0,
        max_tokens=200,
        stop=["\n```\n"],
    )
    print(response.choices[0].message.content)
    details = response.usage.completion_tokens_details
    print(f"prediction tokens: {details.accepted_prediction_tokens} accepted, "
          f"{details.rejected_prediction_tokens} rejected")
    speculation = (response.model_extra or {}).get("speculation")
    if speculation:
        print(f"target passes: {speculation['target_passes']} for "
              f"{response.usage.completion_tokens} tokens")


if __name__ == "__main__":
    main()
