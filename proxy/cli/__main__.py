"""``python -m proxy.cli``: the ``mmguard`` command."""

import sys

from proxy.cli.main import main

sys.exit(main())
