import sys

from pagewise.platform.cli import main

sys.exit(main())
