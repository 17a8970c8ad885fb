"""python -m pagedserve ... -- the same as the `pagedserve` console script."""

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
