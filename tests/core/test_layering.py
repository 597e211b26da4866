"""The core imports only torch: importing it with lightning and accelerate blocked must work."""

import subprocess
import sys
import textwrap


def test_core_imports_without_lightning_or_accelerate():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning", "accelerate", "lightning_fabric"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch
        import lightning_fp8
        from lightning_fp8 import FP8Linear, convert_to_fp8, FP8Recipe
        m = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16)))
        m(torch.randn(2, 16)).sum().backward()
        for name in ("FP8AdamW", "FP8GradScaler"):
            try:
                getattr(lightning_fp8, name)
            except ModuleNotFoundError:
                pass  # not written yet is acceptable here; importing lightning is not
        assert not any(k.split(".")[0] in ("lightning", "accelerate") for k in sys.modules), sorted(sys.modules)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
