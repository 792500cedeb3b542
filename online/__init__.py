"""livedraft control plane: traffic log, collector, caches, trainer, registry, daemon, CLI."""
