"""`python -m boostjax.cli ...` is `boostjax ...`."""

import sys

from boostjax.cli import main

sys.exit(main())
