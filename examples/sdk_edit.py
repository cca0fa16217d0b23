"""Edit a file with foretell.sdk, the file itself as the prediction.

    python examples/sdk_edit.py [--base-url URL] [--model M] [--file F --instruction TEXT]

Against `foretell serve` (embedded model) this prints the unified diff and the statistics. The
embedded 270M base model is a weak editor: expect a faithful copy more than a clever edit; the
point is that the answer is exactly what the model writes without a prediction, only faster.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from foretell.sdk import Client, edit

SAMPLE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="default: FORETELL_BASE_URL, OPENAI_BASE_URL, or "
                                           "http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=os.environ.get("FORETELL_MODEL", "gemma-3-270m"))
    parser.add_argument("--file", help="file to edit (default: a small sample)")
    parser.add_argument("--instruction", default="Rename width to w.")
    args = parser.parse_args()

    text = Path(args.file).read_text(encoding="utf-8") if args.file else SAMPLE
    name = os.path.basename(args.file) if args.file else "shapes.py"
    with Client(args.base_url) as client:
        result = edit(client, text, args.instruction, model=args.model, filename=name)

    print(result.diff or "(no changes)")
    speed = f" ({result.tokens_per_second:.1f} tok/s)" if result.tokens_per_second else ""
    print(f"finish: {result.finish_reason}; {result.completion_tokens} tokens in {result.seconds:.1f} s"
          + speed)
    print(f"prediction tokens: {result.accepted_prediction_tokens} accepted, "
          f"{result.rejected_prediction_tokens} rejected")
    if result.speculation is not None:  # foretell servers report how speculation went
        print(f"target passes: {result.speculation.target_passes} for {result.completion_tokens} tokens")


if __name__ == "__main__":
    main()
