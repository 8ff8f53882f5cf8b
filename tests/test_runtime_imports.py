"""NOTE: [Runtime imports] holds: replaying a schedule needs torch, not the solver or networkx."""

import subprocess
import sys


def test_runtime_imports_neither_solver_nor_networkx():
    code = ("import sys, lazytrain.runtime.trainer, lazytrain.runtime.schedule, lazytrain.timeline\n"
            "bad = sorted(m for m in ('mip', 'networkx', 'jinja2', 'lazytrain.passes', 'lazytrain.solver',\n"
            "                         'lazytrain.analysis') if m in sys.modules)\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
