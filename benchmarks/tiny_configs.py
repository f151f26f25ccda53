"""Write tiny copies of the benchmark architectures (benchmarks/configs/NAME/config.json) to DIR.

Same model type, vocabulary size and embedding tying, but 2 layers of width 32: a forward costs
next to nothing, so a prepared GPU run (benchmarks/gpu_check.sh) can be checked end to end on a
CPU in seconds, with the recorded token ids still valid (DRY_RUN=1), and so can the programs'
dry runs (benchmarks/_common.py).

    python benchmarks/tiny_configs.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_window_layers": 2, "layer_types": ["full_attention"] * 2}


def write_tiny_configs(out: Path) -> Path:
    """The tiny copies under ``out`` (``out/NAME/config.json``); returns ``out``."""
    for source in sorted(CONFIGS.glob("*/config.json")):
        config = {**json.loads(source.read_text()), **TINY}
        target = out / source.parent.name / "config.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    write_tiny_configs(Path(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
