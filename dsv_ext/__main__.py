"""``python -m dsv_ext``: the installation report of ``python -m dsv_ext.info``."""
import sys

from .info import main

sys.exit(main())
