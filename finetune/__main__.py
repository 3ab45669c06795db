"""``python -m finetune COMMAND ...``: the ``finetune`` command (:mod:`finetune.cli`) where its script is not on the
PATH, such as a notebook's ``!python -m finetune train --data reviews.csv``."""

import sys

from finetune.cli import main

if __name__ == "__main__":  # importing the module, as a walk over the package does, runs nothing
    sys.exit(main())
