"""Shared fixtures. Environment first: no model hub at run time, Triton in interpreter mode
(it must be set before anything imports triton), torch's threads."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
# Kernel tests run on CUDA tensors, compiled, under FORETELL_TEST_DEVICE=cuda (benchmarks/gpu_check.py).
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("FORETELL_TEST_DEVICE") == "cuda" else "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads, here and in the commands the suite starts: under pytest-xdist the
# workers share the cores out (one thread each for two workers on two cores); and waiting threads
# sleep rather than spin, as spinning ones make a small matmul ten times slower as soon as
# another busy process shares the cores (measured on the tiny models with a second process busy).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite's exactness oracle is the float32 model (plain greedy decoding, token for token), so
# the commands and servers it starts run float32 unless a test asks for another precision
# (tests/proxy/engine/test_precision.py covers bf16, the default on a CPU with native bf16, and int8/int4).
os.environ.setdefault("FORETELL_DTYPE", "float32")

import ctypes  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402


# The files holding the tests marked ``ray``: the Ray phase collects only these (collecting every
# module costs ~7 s of imports); the other phase checks that no ``ray`` test lives elsewhere.
RAY_TEST_FILES = ("replicas/test_ray_serve.py",)
TESTS_ROOT = os.path.dirname(os.path.abspath(__file__))


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("FORETELL_TEST_PHASE") != "ray" or collection_path.suffix != ".py":
        return None
    relative = os.path.relpath(collection_path, TESTS_ROOT).replace(os.sep, "/")
    if collection_path.name.startswith("test_") and relative not in RAY_TEST_FILES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh's two phases: FORETELL_TEST_PHASE=not-ray keeps every test but those
    marked ``ray``, =ray only those (unset: all). A deselection, not a ``-m``, so that a caller's
    own ``-m`` still applies (pytest keeps only the last ``-m`` it is given)."""
    phase = os.environ.get("FORETELL_TEST_PHASE")
    if phase not in ("ray", "not-ray"):
        return
    elsewhere = sorted({item.nodeid.split("::")[0] for item in items if item.get_closest_marker("ray") is not None
                        and os.path.relpath(item.path, TESTS_ROOT).replace(os.sep, "/") not in RAY_TEST_FILES})
    if elsewhere:
        raise pytest.UsageError(f"tests marked ray outside RAY_TEST_FILES (tests/conftest.py): {elsewhere}")
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("ray") is not None) == (phase == "ray") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_each_module():
    """After a test file's own servers and models are torn down, give their memory back to the
    system (glibc keeps freed arenas otherwise): a worker runs dozens of files, and two workers
    that only grew came close to this machine's 24 GiB."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="session")
def embedded_folder(tmp_path_factory):
    """The embedded model's converted folder (converted and cached on first use). Test sessions
    running at once (pytest-xdist's workers) take turns here, so a first run converts it once."""
    import fcntl

    from foretell.proxy.engine.model_loader import resolve_model_folder

    with open(tmp_path_factory.getbasetemp().parent / "foretell-embedded-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return resolve_model_folder(None)[1]


@pytest.fixture(scope="session")
def tokenizer(embedded_folder):
    """The real Gemma 3 tokenizer: tiny test models share it, so their text is real text."""
    from foretell.proxy.engine.model_loader import shared_tokenizer

    return shared_tokenizer(embedded_folder)  # the one load_model(None) in this process shares


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A tiny randomly initialised Gemma 3 (no download): exactness holds for any model."""
    from tests.helpers import build_tiny_gemma

    return build_tiny_gemma(tokenizer)


@pytest.fixture(scope="session")
def embedded(embedded_folder):
    """The real embedded Gemma 3 270M with its tokenizer."""
    from foretell.proxy.engine.model_loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def greedy(tiny_model, tokenizer) -> str:
    """The tiny model's greedy answer to GREEDY_PROMPT (GREEDY_TOKENS tokens; tests/helpers.py):
    as a prediction, every token can come from it."""
    from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
    from tests.helpers import GREEDY_PROMPT, GREEDY_TOKENS

    engine = SpeculativeEngine(tiny_model, tokenizer)
    ids = tokenizer(GREEDY_PROMPT)["input_ids"]
    return engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=GREEDY_TOKENS)).text


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, tiny_model, tokenizer):
    """The tiny model saved as a Hugging Face folder, for commands that load a model by path."""
    folder = tmp_path_factory.mktemp("tiny-gemma")
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def stub_upstream():
    """A stub OpenAI-compatible upstream on 127.0.0.1 (harness/upstream_stub.py)."""
    from harness.upstream_stub import StubServer

    with StubServer() as stub:
        yield stub


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_folder, stub_upstream):
    """The server ``foretell serve --model TINY --served-model-name tiny --config ...`` builds, in
    this process on a real port (tests/serving.py): the tiny model as "tiny" (float32, no
    calibration, no API key) and "up-ok" forwarded to ``stub_upstream``. Shared by every test
    that needs no settings of its own; ``.base`` is its address."""
    from tests.serving import route_table, serve, tiny_app

    routes = route_table(f'[upstreams.stub]\nbase_url = "{stub_upstream.base_url}"\nmax_retries = 0\n\n'
                         '[models.up-ok]\nupstream = "stub"\n', tmp_path_factory.mktemp("tiny-server"))
    with serve(tiny_app(tiny_model_folder, routes=routes), "tiny-server") as served:
        yield served
