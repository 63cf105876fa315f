"""``python -m tiered_offload`` is the ``tiered-offload`` command."""

from tiered_offload.cli import main

raise SystemExit(main())
