"""``python -m glmvit COMMAND``: see :mod:`glmvit.cli`. As the process's own command it tracks which glmvit code
runs (:func:`glmvit.fingerprint.start`) before any command is imported, so its records name the units it ran."""
import sys

from . import fingerprint
from .cli import main

if __name__ == "__main__":
    fingerprint.start()
    sys.exit(main())
