"""Run the Hugging Face parity check of a recipe and print the fixed table (exit code 1 on any FAIL).

    python skills/validate-correctness/scripts/check_parity.py --recipe qwen3_30b_a3b [--hf-dir DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, so `recipes` and `tools` import

from tools.hf_parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
