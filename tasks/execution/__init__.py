"""How stage tasks execute: caching on content, retries, the training slot, core sharing, and remote hand-over."""
