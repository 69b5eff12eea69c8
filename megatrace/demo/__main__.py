"""``python -m megatrace.demo``: run one rank of the demo job (see :mod:`megatrace.demo.worker`)."""

import sys

from megatrace.demo.worker import main

sys.exit(main())
