"""``python -m tiered_offload`` is the ``tiered-offload`` command."""

from .cli import main

raise SystemExit(main())
