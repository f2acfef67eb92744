"""kvstrata.router.

Its request-path modules load compiled (kvstrata/compiled.py) when a build of these very sources
exists; else from source. This runs before any of them is imported.
"""

import logging

from kvstrata.compiled import install

COMPILED = install()
if not COMPILED.active:
    logging.getLogger("kvstrata.router").debug("router modules from source: %s", COMPILED.reason)
