"""The bare install is the SDK alone: it must import without torch."""

import subprocess
import sys

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


def test_kernels_import_without_triton():
    code = BLOCK_TORCH.replace("('torch', 'transformers', 'triton')", "('triton',)").replace(
        "import foretell, foretell.sdk, foretell.proxy", "import foretell.kernels")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
