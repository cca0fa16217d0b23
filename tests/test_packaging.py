"""Packaging: the bare install is the SDK alone (it must import without torch), and a wheel built
from the sources (once) carries what it must."""

import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SDK_MODULES = sorted("foretell.sdk." + m.name for m in pkgutil.iter_modules(
    [str(Path(__file__).resolve().parents[1] / "sdk")]))

BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'triton'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import foretell, foretell.sdk, foretell.proxy
print('ok')
"""


def test_sdk_imports_without_torch():
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_sdk_module_and_foretell_edit_work_without_torch_or_pydantic():
    assert len(SDK_MODULES) >= 10, SDK_MODULES
    blocked = BLOCK_TORCH.replace("('torch', 'transformers', 'triton')",
                                  "('torch', 'transformers', 'triton', 'pydantic')")
    code = blocked.replace("import foretell, foretell.sdk, foretell.proxy",
                           "import importlib\n" + "".join(f"importlib.import_module({m!r})\n"
                                                          for m in SDK_MODULES)
                           + "from foretell.cli import main\nmain(['edit', '--help'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--instruction" in result.stdout and "--write" in result.stdout


def test_kernels_import_without_triton():
    code = BLOCK_TORCH.replace("('torch', 'transformers', 'triton')", "('triton',)").replace(
        "import foretell, foretell.sdk, foretell.proxy", "import foretell.kernels")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built once from a copy of the sources, so that setuptools' build/ and egg-info
    never land in the checkout; without build isolation, so that no index is needed."""
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("foretell", "sdk", "proxy"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-q", str(source), "-w", str(folder / "dist")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (built,) = (folder / "dist").glob("foretell-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_a_wheel_carries_the_license_and_the_py_typed_markers(wheel):
    names = set(wheel.namelist())
    assert {"foretell/py.typed", "foretell/sdk/py.typed", "foretell/__main__.py"} <= names
    license_files = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
    assert license_files, sorted(names)
    text = wheel.read(license_files[0]).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_a_wheel_carries_every_module_of_the_sources(wheel):
    """Every .py file of the packages' folders is in the wheel under its import path (a new
    subpackage missing from pyproject's package list would import from a checkout only)."""
    names = set(wheel.namelist())
    where = {"foretell": "foretell", "sdk": "foretell/sdk", "proxy": "foretell/proxy"}
    missing = [str(path) for folder, target in where.items() for path in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in path.parts
               and f"{target}/{path.relative_to(ROOT / folder).as_posix()}" not in names]
    assert not missing, missing


def test_a_wheel_carries_the_playground_page(wheel):
    """The page is package data: the wheel holds its three files."""
    assert {f"foretell/proxy/server/static/{name}"
            for name in ("playground.html", "playground.css", "playground.js")} <= set(wheel.namelist())


def test_the_license_file_is_the_apache_2_0_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    for heading in ("1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                    "4. Redistribution.", "7. Disclaimer of Warranty.", "8. Limitation of Liability.",
                    "9. Accepting Warranty or Additional Liability."):
        assert heading in text
