"""The generators of the posts' regions, one module per kind of content; each registers its generators with
`@generator` (posts/engine.py) when imported. What each writes: posts/README.md."""

from . import boxes, figure, lora, measured, navigation, predictions, provenance, source, tables, value  # noqa: F401
