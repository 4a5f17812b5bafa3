"""`make demo`: the whole delivery chain on an embedded default, end to end (modelpack/demo.py).

The same demo a pip user runs as ``python -m modelpack.demo``; from the checkout everything lands
under examples/generated/ (ignored by git), and rerunning starts from scratch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from modelpack.demo import main

if __name__ == "__main__":
    generated = Path(__file__).resolve().parent / "generated"
    shutil.rmtree(generated, ignore_errors=True)  # ignored by git: the demo's own folder
    main(generated)
