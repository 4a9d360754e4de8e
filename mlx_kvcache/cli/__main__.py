"""``python -m mlx_kvcache.cli``: same as the ``mlx-kvcache`` script."""

import sys

from . import main

sys.exit(main())
