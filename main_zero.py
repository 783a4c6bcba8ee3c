"""Train a GPT model: `python main_zero.py --config configs/tiny.yaml [--set key=value ...]`.

Intentionally thin; everything lives in the zerolm package (`zerolm train` is the same command).
"""

import sys

from zerolm.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
