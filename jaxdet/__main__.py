"""``python -m jaxdet``: the same command line as the ``jaxdet`` script (``jaxdet report``)."""

import sys

from jaxdet._src.report import cli

sys.exit(cli())
