"""`python -m app.cli ...`: the `bert` command without its console script (bert up starts its worker so)."""

import sys

from app.cli import main

sys.exit(main())
