"""`python -m model ...`: the model-only `bert` commands (vocab, import, info, training)."""

import sys

from .cli import main

sys.exit(main())
