"""The torchax shim (jaxtune/runtime/compat.py): torchax imports and runs an op on every torch the
bounds allow, and torch's operator lookups are restored. Run on both stacks (make test, make
test-latest): torch 2.13 lacks 22 named-tensor overloads, torch 2.14 and later also whole operators."""

import subprocess
import sys
import textwrap


def test_torchax_imports_and_runs_an_op_with_lookup_restored():
    # A fresh interpreter: the shim must work on the very first torchax import.
    code = textwrap.dedent(
        """
        import torch
        from torch._ops import OpOverloadPacket, _OpNamespace
        original = OpOverloadPacket.__getattr__, _OpNamespace.__getattr__
        from jaxtune.runtime.compat import torchax_env, missing_overloads
        env = torchax_env()
        assert (OpOverloadPacket.__getattr__, _OpNamespace.__getattr__) == original, "lookups not restored"
        version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        expected = {(2, 13): ["aten.prod.dim_Dimname"], (2, 14): ["aten.prod.dim_Dimname", "aten.cholesky.default"]}
        for name in expected[min(max(version, (2, 13)), (2, 14))] if version >= (2, 13) else []:
            assert name in missing_overloads, (name, missing_overloads)
            operator, overload = name.split(".")[1:]
            try:
                getattr(getattr(torch.ops.aten, operator), overload)
            except AttributeError:
                pass
            else:
                raise AssertionError(f"placeholder {name} leaked outside the shim")
        if version < (2, 13):
            assert missing_overloads == [], missing_overloads
        with env:
            x = torch.arange(6, dtype=torch.float32, device="jax").reshape(2, 3)
            y = (x @ x.T).sum()
            print(torch.__version__, len(missing_overloads), float(y.item()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # [[0,1,2],[3,4,5]] @ its transpose = [[5,14],[14,50]], summed = 83
    assert out.stdout.strip().splitlines()[-1].endswith(" 83.0"), out.stdout
