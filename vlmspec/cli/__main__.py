"""`python -m vlmspec.cli ...` = `vlmspec ...`."""

import sys

from vlmspec.cli import main

sys.exit(main())
