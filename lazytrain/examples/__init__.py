"""Model files bundled with lazytrain; each follows the model-file convention
(`build_model()` and `example_batch()`), so `lazytrain compile` takes their paths."""

from pathlib import Path

DIR = Path(__file__).parent
DEFAULT = DIR / "tiny_qwen.py"
