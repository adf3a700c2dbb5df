"""The torch 2.13 shim: torchax imports, runs an op, and the operator lookup is restored."""

import subprocess
import sys
import textwrap


def test_torchax_imports_and_runs_an_op_with_lookup_restored():
    # A fresh interpreter: the shim must work on the very first torchax import.
    code = textwrap.dedent(
        """
        import torch
        from torch._ops import OpOverloadPacket
        original = OpOverloadPacket.__getattr__
        from jaxtune.runtime.compat import torchax_env, missing_overloads
        env = torchax_env()
        assert OpOverloadPacket.__getattr__ is original, "lookup not restored"
        assert "aten.prod.dim_Dimname" in missing_overloads, missing_overloads
        try:
            torch.ops.aten.prod.dim_Dimname
        except AttributeError:
            pass
        else:
            raise AssertionError("placeholder leaked outside the shim")
        with env:
            x = torch.arange(6, dtype=torch.float32, device="jax").reshape(2, 3)
            y = (x @ x.T).sum()
            print(float(y.item()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # [[0,1,2],[3,4,5]] @ its transpose = [[5,14],[14,50]], summed = 83
    assert out.stdout.strip().splitlines()[-1] == "83.0"
