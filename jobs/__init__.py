"""Ray job entry points: ``python -m jobs.<name> --config experiments/<x>.yaml [k=v ...]``.

Each ``jobs/<name>.py`` is a thin shim over ``speclab.jobs.<name>.main``: the jobs
themselves (:mod:`speclab.jobs`) and the stages they share (:mod:`speclab.pipelines`)
live in the library, and no job module imports another. The package makes ``speclab``
importable from a plain checkout (e.g. a Ray Jobs working_dir) by putting ``platform/``
on ``sys.path`` when it is not installed.
"""

import sys
from pathlib import Path

try:  # installed (pip install -e .) or shipped as a py_module
    import speclab  # noqa: F401
except ImportError:  # plain checkout: platform/ holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))
