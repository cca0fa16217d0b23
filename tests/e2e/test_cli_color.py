"""``foretell generate --color`` and ``foretell edit --color``: text marked by token origin (green
from the prediction, cyan from prompt lookup), ``auto`` only on a terminal and without
``NO_COLOR``."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from foretell.origin_colors import RESET, STYLES, paint, paint_within, use_color
from tests.helpers import GREEDY_PROMPT, GREEDY_TOKENS

GREEN, CYAN = STYLES["prediction"], STYLES["prompt_lookup"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROMPT, TOKENS = GREEDY_PROMPT, GREEDY_TOKENS  # the greedy fixture's request


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---- the rules ----------------------------------------------------------------------------------

def test_auto_colours_a_terminal_unless_no_color_is_set():
    assert use_color("auto", Terminal(), {}) is True
    assert use_color("auto", io.StringIO(), {}) is False  # a pipe or a file
    assert use_color("auto", Terminal(), {"NO_COLOR": "1"}) is False
    assert use_color("auto", Terminal(), {"NO_COLOR": ""}) is True  # set but empty: no effect
    assert use_color("auto", Terminal(), {"TERM": "dumb"}) is False
    assert use_color("always", io.StringIO(), {"NO_COLOR": "1"}) is True  # the flag wins
    assert use_color("never", Terminal(), {}) is False


def test_paint_closes_the_colour_before_each_line_break():
    assert paint("a\nb\n", "prediction") == f"{GREEN}a{RESET}\n{GREEN}b{RESET}\n"
    assert paint("x", "prompt_lookup") == f"{CYAN}x{RESET}"
    assert paint("x", None) == "x"


def test_paint_within_colours_the_file_inside_the_answer():
    spans = [("```python\ndef f", "prediction"), ("():\n    pass", None), ("\n", "prompt_lookup")]
    painted = paint_within(spans, "def f():\n    pass\n")
    assert ANSI.sub("", painted) == "def f():\n    pass\n"
    assert painted.startswith(f"{GREEN}def f{RESET}():")
    assert paint_within(spans, "not in the answer\n") == "not in the answer\n"


# ---- foretell generate ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory, greedy):
    folder = tmp_path_factory.mktemp("color")
    (folder / "prompt.txt").write_text(PROMPT)
    (folder / "prediction.txt").write_text(greedy)  # every token can come from it
    return folder


def generate_args(tiny_model_folder, files, color: str) -> list[str]:
    return [sys.executable, "-m", "foretell.cli", "generate", "--model", str(tiny_model_folder),
            "--prompt-file", str(files / "prompt.txt"), "--prediction-file", str(files / "prediction.txt"),
            "--max-tokens", str(TOKENS), "--no-calibrate", "--color", color]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def test_generate_color_always_marks_prediction_tokens(tiny_model_folder, files, greedy):
    result = subprocess.run(generate_args(tiny_model_folder, files, "always"), capture_output=True,
                            text=True, timeout=600, env=clean_env(NO_COLOR="1"))
    assert result.returncode == 0, result.stderr
    assert GREEN in result.stdout and RESET in result.stdout
    assert ANSI.sub("", result.stdout).rstrip("\n") == greedy  # the codes add nothing else
    green = "".join(re.findall(re.escape(GREEN) + r"(.*?)" + re.escape(RESET), result.stdout, re.S))
    assert len(green) > len(greedy) / 2  # most of it was accepted from the prediction
    assert "colours:" in result.stderr and "prediction" in result.stderr  # the legend


def test_generate_color_never_writes_no_codes(tiny_model_folder, files, greedy):
    result = subprocess.run(generate_args(tiny_model_folder, files, "never"), capture_output=True,
                            text=True, timeout=600, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x1b" not in result.stderr
    assert result.stdout.rstrip("\n") == greedy


def run_on_terminal(args: list[str], env: dict) -> tuple[int, str]:
    """Run with stdout on a pseudo-terminal; returns (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(args, stdout=slave, stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    output = bytearray()
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        output += data
    os.close(master)
    return process.wait(timeout=600), output.decode("utf-8", "replace")


def test_generate_color_auto_colours_a_terminal_and_no_color_turns_it_off(tiny_model_folder, files):
    args = generate_args(tiny_model_folder, files, "auto")
    code, shown = run_on_terminal(args, clean_env())
    assert code == 0 and GREEN in shown
    code, shown = run_on_terminal(args, clean_env(NO_COLOR="1"))
    assert code == 0 and "\x1b[" not in shown and shown.strip()


def test_generate_color_auto_writes_no_codes_into_a_pipe(tiny_model_folder, files):
    result = subprocess.run(generate_args(tiny_model_folder, files, "auto"), capture_output=True,
                            text=True, timeout=600, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout


# ---- foretell edit, against a scripted server -------------------------------------------------------

FILE = "def area(w, h):\n    return w * h\n"


class ScriptedServer:
    """Answers an edit with the file unchanged, in two chunks, the first half from the
    prediction; reports origins only when asked, and says it is foretell only when ``foretell``."""

    def __init__(self, foretell: bool):
        self.foretell, self.bodies = foretell, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send_json(self, payload, content_type="application/json"):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                if server.foretell:
                    self.send_header("x-foretell-version", "0.1.0")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.send_json({"object": "list", "data": [{"id": "m", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.bodies.append(body)
                report = (body.get("speculation") or {}).get("report_origins")
                answer = body["prediction"]["content"][:-1]  # cut by the stop string
                half = len(answer) // 2
                pieces = [(answer[:half], [(answer[:half], "prediction")]),
                          (answer[half:], [(answer[half:-4], None), (answer[-4:], "prompt_lookup")])]
                events = []
                for text, spans in pieces:
                    chunk = {"object": "chat.completion.chunk", "model": "m",
                             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
                    if report:
                        chunk["foretell"] = {"origins": [{"text": t, "origin": o} for t, o in spans]}
                    events.append(chunk)
                events.append({"object": "chat.completion.chunk", "model": "m",
                               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self.send_json(stream, "text/event-stream")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_edit(tmp_path, base: str, *args: str):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORETELL_", "OPENAI_", "NO_COLOR"))}
    return subprocess.run([sys.executable, "-m", "foretell.cli", "edit", str(path), "-i", "Keep it.",
                           "--base-url", base, *args], capture_output=True, text=True, timeout=120, env=env)


def test_edit_color_asks_a_foretell_server_for_origins_and_colours_the_file(tmp_path):
    with ScriptedServer(foretell=True) as server:
        result = run_edit(tmp_path, server.base, "--color", "always")
    assert result.returncode == 0, result.stderr
    assert server.bodies[0]["speculation"] == {"report_origins": True}
    assert ANSI.sub("", result.stdout) == FILE
    assert GREEN in result.stdout and CYAN in result.stdout
    assert "colours:" in result.stderr


def test_edit_never_sends_report_origins_to_other_servers(tmp_path):
    with ScriptedServer(foretell=False) as server:
        result = run_edit(tmp_path, server.base, "--color", "always")
    assert result.returncode == 0, result.stderr
    assert "speculation" not in server.bodies[0]
    assert result.stdout == FILE  # nothing to colour by
    assert "reported no token origins" in result.stderr


def test_edit_without_color_asks_for_nothing_and_writes_no_codes(tmp_path):
    with ScriptedServer(foretell=True) as server:
        result = run_edit(tmp_path, server.base, "--color", "never")
        auto = run_edit(tmp_path, server.base)  # stdout is a pipe: auto means no colour
    assert result.returncode == 0 and auto.returncode == 0, result.stderr + auto.stderr
    assert result.stdout == auto.stdout == FILE
    assert all("speculation" not in body for body in server.bodies)
