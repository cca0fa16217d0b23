"""The bare install is the SDK alone: it must import without torch."""

import pkgutil
import subprocess
import sys
from pathlib import Path

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
