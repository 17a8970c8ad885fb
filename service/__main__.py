"""python -m service [flags] -- the same as `pagedserve serve`."""

import sys

from service.cli import main

sys.exit(main())
