"""Pictures (and, later, clips) as the pipelines and the cache take them."""
