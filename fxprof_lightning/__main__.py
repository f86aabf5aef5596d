"""``python -m fxprof_lightning compare A B`` / ``report RUN``: the ``fxprof`` command line (see ``cli``)."""

import sys

from fxprof_lightning.cli import main

sys.exit(main())
