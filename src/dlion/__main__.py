import sys

from dlion.cli import main

sys.exit(main())
