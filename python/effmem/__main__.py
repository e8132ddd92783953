"""`python -m effmem`: the `effmem` command (effmem.cli)."""
import sys

from effmem.cli import main

sys.exit(main())
