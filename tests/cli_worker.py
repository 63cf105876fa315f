"""``tiered-offload`` as a script a zygote's worker runs (tools/zygote.py): one rank of a
``torchrun ... -m tiered_offload`` launch, forked with the environment torchrun gives a rank."""

from tiered_offload.cli import main

raise SystemExit(main())
