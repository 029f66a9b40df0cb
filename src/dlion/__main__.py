import sys

from dlion.lab.cli import main

sys.exit(main())
