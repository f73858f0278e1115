"""``python -m cluster`` is the ``kvrelay`` command."""
import sys

from cluster.cli import main

sys.exit(main())
