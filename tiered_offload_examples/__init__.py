"""The demo and its model: recipes built on tiered-offload, kept out of the library package."""
