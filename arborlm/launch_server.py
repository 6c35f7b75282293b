"""`python -m arborlm.launch_server --model-path ... --port ...`: SGLang's launch command
(`python -m sglang.launch_server`) spelled for arborlm, the same as `arborlm serve ...`."""

import sys

from arborlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
