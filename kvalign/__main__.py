import sys

from kvalign.cli import main

sys.exit(main())
