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


def test_analysis_runs_without_the_solver():
    """NOTE: [Analysis without the solver] holds: `lazytrain profile` runs `analyse` where python-mip
    is not installed (a GPU machine's image), so capture through fusion must not import it."""
    code = ("import sys\n"
            "sys.modules['mip'] = None  # importing it now raises ImportError\n"
            "import torch\n"
            "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
            "from lazytrain import hardware\n"
            "from lazytrain.pipeline import analyse\n"
            "from lazytrain.passes.fusion import elementwise_share\n"
            "config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,\n"
            "                     num_key_value_heads=2, vocab_size=64, use_cache=False, attn_implementation='sdpa')\n"
            "ids = torch.zeros(2, 16, dtype=torch.long)\n"
            "_, stages = analyse(Qwen2ForCausalLM(config), {'input_ids': ids, 'labels': ids}, hardware.load('h200'),\n"
            "                    fuse_stages=False)\n"
            "print(0 < elementwise_share(stages) < 1, 'mip' in sys.modules and sys.modules['mip'] is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]
