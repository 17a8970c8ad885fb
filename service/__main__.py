"""python -m service [flags] -- the same as `pagedserve serve`."""

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main())
